package cudaipc

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// HashChunk bounds the pinned staging one gather of the integrity check
// uses: a full check of an engine's KV goes through it in pieces (pinning
// tens of gigabytes at once stalls the whole device).
const HashChunk = 256 << 20

// NewPlane returns an agent's CUDA state; the driver loads on first use
// through open (nil: cuda.Load, which dlopens libcuda).
func NewPlane(log *zap.Logger, open func() (cuda.Driver, error)) *Plane {
	if open == nil {
		open = loadDriver
	}
	return &Plane{log: log, open: open}
}

func loadDriver() (cuda.Driver, error) {
	lib, err := cuda.Load()
	if err != nil {
		// (not returned as is: a nil *Lib in the interface would pass
		// for a driver)
		return nil, err
	}
	return lib, nil
}

// Plane is an agent's CUDA state, made on first use: the driver and a
// stream per device. A migration's IPC mappings of both engines' KV are
// opened at its first cuda_ipc round and kept for the next ones and the
// end-to-end check after the final round (opening a peer's allocation of
// tens of gigabytes is not free, and the final round and the check run
// inside the pause); they close when a round fails, when the Host
// releases the migration, or when nothing used them for MappingIdle — an
// engine may free its KV (sleep, shutdown) after a migration, and no
// mapping may outlive it.
type Plane struct {
	log  *zap.Logger
	open func() (cuda.Driver, error) // loads the driver (cuda.Load)

	mu      sync.Mutex
	drv     cuda.Driver
	streams map[int]cuda.Stream
	// targets are this engine's regions mapped for a migration's tcp_shm
	// writes (GPU KV received over the network), by session.
	targets map[string]*target
	// pairs are both engines' regions mapped for a migration's cuda_ipc
	// rounds, by session.
	pairs map[string]*ipcPair
	// hashers stage the blocks the integrity check reads, one per device,
	// kept: allocating pinned memory inside the pause would cost more than
	// the check. hashMu is held while a check reads its staging.
	hashers map[int]*Copier
	hashMu  sync.Mutex
	// ordinals are this process's CUDA ordinals by GPU UUID, read once
	// when a layout first names a GPU by UUID.
	ordinals map[string]int
}

// MappingIdle is how long a migration's mappings stay open with no round
// using them (a Host that died mid-migration never sends the final one).
const MappingIdle = time.Minute

// ipcPair is a migration's mappings of the source's and the target's KV.
type ipcPair struct {
	key      string // the regions they map: a changed layout re-opens
	src, dst Regions
	close    func()
	used     time.Time
}

type target struct {
	dev   int
	key   string
	dst   Regions
	sizes []uint64
	close func()
}

// copierFor returns a copier on the stream of the GPU that holds m (g.mu
// held).
func (g *Plane) copierFor(m hooks.Memory) (*Copier, error) {
	if err := g.load(); err != nil {
		return nil, err
	}
	dev, err := g.ordinal(m)
	if err != nil {
		return nil, err
	}
	return g.copier(dev)
}

// ordinal is the CUDA ordinal, in this process, of the GPU that holds m:
// found by the GPU's UUID where the exporter gave it (an engine started
// with CUDA_VISIBLE_DEVICES=1 calls that GPU 0), else the exporter's own
// ordinal (g.mu held, the driver loaded).
func (g *Plane) ordinal(m hooks.Memory) (int, error) {
	if m.DeviceUUID == "" {
		return m.Device, nil
	}
	if g.ordinals == nil {
		n, err := g.drv.DeviceCount()
		if err != nil {
			return 0, fmt.Errorf("GPU KV: count the GPUs: %w", err)
		}
		ords := make(map[string]int, n)
		for i := 0; i < n; i++ {
			u, err := g.drv.DeviceUUID(i)
			if err != nil {
				return 0, fmt.Errorf("GPU KV: name GPU %d: %w", i, err)
			}
			ords[u] = i
		}
		g.ordinals = ords
	}
	dev, ok := g.ordinals[m.DeviceUUID]
	if !ok {
		return 0, fmt.Errorf("GPU KV: the engine's GPU %s (its device %d) is not visible to this agent, which sees %d GPUs: start the agent with every GPU the engines use visible (CUDA_VISIBLE_DEVICES unset or listing them)",
			m.DeviceUUID, m.Device, len(g.ordinals))
	}
	return dev, nil
}

// Sees says why this agent cannot reach every GPU the layouts' regions
// are on (nil: it can). Regions without a UUID are taken as visible: their
// ordinal is the exporter's, and only opening them can tell.
func (g *Plane) Sees(layouts ...hooks.Layout) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, l := range layouts {
		for _, r := range l.Regions {
			if r.Memory.Kind != hooks.MemoryCUDAIPC || r.Memory.DeviceUUID == "" {
				continue
			}
			if err := g.load(); err != nil {
				return err
			}
			if _, err := g.ordinal(r.Memory); err != nil {
				return err
			}
		}
	}
	return nil
}

// load loads the driver on first use (g.mu held).
func (g *Plane) load() error {
	if g.drv != nil {
		return nil
	}
	drv, err := g.open()
	if err != nil {
		return fmt.Errorf("GPU KV: %w", err)
	}
	g.drv = drv
	g.streams, g.targets, g.pairs, g.hashers = map[int]cuda.Stream{}, map[string]*target{}, map[string]*ipcPair{}, map[int]*Copier{}
	return nil
}

// copier returns a copier on dev's stream, made once per device (g.mu
// held, the driver loaded).
func (g *Plane) copier(dev int) (*Copier, error) {
	var err error
	s, ok := g.streams[dev]
	if !ok {
		if k, ok := g.drv.(interface{ PrepareKernels(int) error }); ok {
			// The copy kernel compiles at load: not inside a round.
			if err := k.PrepareKernels(dev); err != nil {
				return nil, err
			}
		}
		if s, err = g.drv.NewStream(dev); err != nil {
			return nil, err
		}
		g.streams[dev] = s
	}
	return &Copier{Driver: g.drv, Device: dev, Stream: s}, nil
}

// Release unmaps everything a session mapped: its tcp_shm target regions
// and its cuda_ipc pair.
func (g *Plane) Release(session string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if t := g.targets[session]; t != nil {
		t.close()
		delete(g.targets, session)
	}
	g.dropPair(session)
}

// dropPair closes a session's cuda_ipc mappings (g.mu held).
func (g *Plane) dropPair(session string) {
	if p := g.pairs[session]; p != nil {
		p.close()
		delete(g.pairs, session)
	}
}

// pair returns session's mappings of src and dst on dev, opening them on
// the first round (g.mu held). Other sessions' mappings idle past
// MappingIdle are closed on the way.
func (g *Plane) pair(session string, dev int, src, dst hooks.Layout, now time.Time) (*ipcPair, error) {
	for id, p := range g.pairs {
		if id != session && now.Sub(p.used) > MappingIdle {
			g.dropPair(id)
		}
	}
	key := regionsKey(src) + "→" + regionsKey(dst)
	if p := g.pairs[session]; p != nil {
		if p.key == key {
			p.used = now
			return p, nil
		}
		g.dropPair(session)
	}
	srcPtrs, closeSrc, err := openRegions(g.drv, dev, src)
	if err != nil {
		return nil, err
	}
	dstPtrs, closeDst, err := openRegions(g.drv, dev, dst)
	if err != nil {
		closeSrc()
		return nil, err
	}
	p := &ipcPair{key: key, src: srcPtrs, dst: dstPtrs, used: now, close: func() { closeDst(); closeSrc() }}
	g.pairs[session] = p
	return p, nil
}

// regionsKey names the memory a layout's regions are in.
func regionsKey(l hooks.Layout) string {
	var b strings.Builder
	fmt.Fprintf(&b, "gen %d;", l.KVGeneration)
	for _, r := range l.Regions {
		fmt.Fprintf(&b, "%s:%d:%d:%d:%d;", r.Memory.IPCHandle, r.Memory.PID, r.Memory.DevicePointer, r.Memory.Offset, r.Size)
	}
	return b.String()
}

// mapTarget returns session's mapping of this engine's GPU regions, made on
// first use (g.mu held).
func (g *Plane) mapTarget(session string, l hooks.Layout) (*Copier, *target, error) {
	c, err := g.copierFor(l.Regions[0].Memory)
	if err != nil {
		return nil, nil, err
	}
	key := regionsKey(l)
	t := g.targets[session]
	if t != nil && t.key != key {
		t.close()
		delete(g.targets, session)
		t = nil
	}
	if t == nil {
		dst, closeAll, err := openRegions(g.drv, c.Device, l)
		if err != nil {
			return nil, nil, err
		}
		t = &target{dev: c.Device, key: key, dst: dst, close: closeAll}
		for _, r := range l.Regions {
			t.sizes = append(t.sizes, uint64(r.Size))
		}
		g.targets[session] = t
	}
	return c, t, nil
}

// PrepareTarget maps this engine's GPU regions for session ahead of its
// rounds, and readies the integrity check's staging.
func (g *Plane) PrepareTarget(session string, l hooks.Layout) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	_, t, err := g.mapTarget(session, l)
	if err != nil {
		return err
	}
	_, err = g.hasher(t.dev)
	return err
}

// Warm makes this agent's CUDA state for the GPUs that l's regions are
// on: the driver, each device's context, stream and kernels, and the
// check's pinned staging. Left to first use, a migration paid for them
// twice: on one H100 (2026-12-06) the source agent's first round 0 spent
// ~390 ms on them beside a 32 ms copy, and the target's first
// prepare_target 377 ms. A layout not in GPU memory needs nothing.
func (g *Plane) Warm(l hooks.Layout) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	warmed := map[int]bool{}
	for _, r := range l.Regions {
		if r.Memory.Kind != hooks.MemoryCUDAIPC {
			continue
		}
		c, err := g.copierFor(r.Memory)
		if err != nil {
			return err
		}
		if warmed[c.Device] {
			continue
		}
		warmed[c.Device] = true
		if _, err := g.hasher(c.Device); err != nil {
			return err
		}
	}
	return nil
}

// hasher returns dev's staging for the integrity check, made once at its
// full size (g.mu held; the device's copier exists).
func (g *Plane) hasher(dev int) (*Copier, error) {
	if g.hashers == nil {
		g.hashers = map[int]*Copier{}
	}
	if c := g.hashers[dev]; c != nil {
		return c, nil
	}
	c := &Copier{Driver: g.drv, Device: dev, Stream: g.streams[dev]}
	if err := c.Reserve(HashChunk); err != nil {
		return nil, err
	}
	g.hashers[dev] = c
	return c, nil
}

// Sink is a tcp_shm target writing session's data into this engine's GPU
// regions (mapped once per session, staged per connection).
func (g *Plane) Sink(session string, l hooks.Layout) (*Sink, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	c, t, err := g.mapTarget(session, l)
	if err != nil {
		return nil, err
	}
	return NewSink(c, t.dst, t.sizes)
}

// Close unmaps everything and unloads the driver.
func (g *Plane) Close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.drv == nil {
		return
	}
	for _, t := range g.targets {
		t.close()
	}
	for id := range g.pairs {
		g.dropPair(id)
	}
	for _, h := range g.hashers {
		h.Close()
	}
	for dev, s := range g.streams {
		_ = g.drv.DestroyStream(dev, s)
	}
	g.drv.Close()
	g.drv, g.streams = nil, nil
}

// openRegions maps a layout's regions into dev's context.
func openRegions(drv cuda.Driver, dev int, l hooks.Layout) (Regions, func(), error) {
	var opened []cuda.DevicePtr
	closeAll := func() {
		for _, p := range opened {
			_ = drv.IPCClose(dev, p)
		}
	}
	out := make(Regions, len(l.Regions))
	for i, r := range l.Regions {
		if r.Memory.PID == os.Getpid() && r.Memory.DevicePointer != 0 {
			// Our own allocation (an in-process stack): CUDA will not open
			// it through IPC, and needs no mapping.
			if err := drv.EnablePeer(dev, r.Memory.Device); err != nil {
				closeAll()
				return nil, nil, err
			}
			out[i] = cuda.DevicePtr(r.Memory.DevicePointer) + cuda.DevicePtr(r.Memory.Offset)
			continue
		}
		raw, err := base64.StdEncoding.DecodeString(r.Memory.IPCHandle)
		var h cuda.IPCHandle
		if err != nil || len(raw) != len(h) {
			closeAll()
			return nil, nil, fmt.Errorf("region %d: bad IPC handle", i)
		}
		copy(h[:], raw)
		p, err := drv.IPCOpen(dev, h)
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("open region %d (GPU %d %s) through IPC: %w", i, r.Memory.Device, r.Memory.DeviceUUID, err)
		}
		opened = append(opened, p)
		out[i] = p + cuda.DevicePtr(r.Memory.Offset)
	}
	return out, closeAll, nil
}

// withSource maps a GPU source's regions on its device and hands fn a
// copier on that device's stream; the mappings close when fn returns.
func (g *Plane) withSource(src hooks.Layout, fn func(c *Copier, srcPtrs Regions) error) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	c, err := g.copierFor(src.Regions[0].Memory)
	if err != nil {
		return err
	}
	srcPtrs, closeSrc, err := openRegions(g.drv, c.Device, src)
	if err != nil {
		return err
	}
	defer closeSrc()
	return fn(c, srcPtrs)
}

// Copy runs one round's copies GPU to GPU: the plan's runs, from the
// source engine's regions to the target's, issued from the source GPU
// through the session's mappings (closed when a round fails or the Host
// releases the migration).
func (g *Plane) Copy(session string, src, dst hooks.Layout, copies []kvlayout.BlockCopy, fault transfer.Fault) (transfer.Stats, error) {
	start := time.Now()
	geo := src.Geometry
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), transfer.Specs(src), transfer.Specs(dst), copies)
	if err != nil {
		return transfer.Stats{}, err
	}
	// The kernel writes wherever a run says: every run must lie in the
	// regions, and on the target inside the blocks this round copies to.
	if err := checkRuns(src, dst, copies, runs); err != nil {
		return transfer.Stats{}, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	c, err := g.copierFor(src.Regions[0].Memory)
	if err != nil {
		return transfer.Stats{}, err
	}
	planned := time.Now()
	p, err := g.pair(session, c.Device, src, dst, planned)
	if err != nil {
		return transfer.Stats{}, err
	}
	if _, err := g.hasher(c.Device); err != nil { // the check after the final round reads through it
		return transfer.Stats{}, err
	}
	mapped := time.Now()
	defer func() {
		g.log.Debug("cuda_ipc copy", zap.Int("runs", len(runs)), zap.Duration("plan", planned.Sub(start)),
			zap.Duration("map", mapped.Sub(planned)), zap.Duration("copy", time.Since(mapped)))
	}()
	switch fault {
	case transfer.NoFault:
		err = c.Run(p.src, p.dst, runs)
	case transfer.CorruptSilently:
		// Tests of a copy that reports success with wrong bytes: the first
		// run reads from 16 bytes beside where it should.
		if len(runs) > 0 {
			r := &runs[0]
			if r.SrcOffset >= 16 {
				r.SrcOffset -= 16
			} else {
				r.SrcOffset += 16
			}
		}
		err = c.Run(p.src, p.dst, runs)
	default:
		// Tests of a copy failing halfway: half the runs land, then the
		// round fails and the migration must roll back.
		if err = c.Run(p.src, p.dst, runs[:len(runs)/2]); err == nil {
			err = errors.New("cuda_ipc: injected fault: copy failed halfway")
		}
	}
	if err != nil {
		g.dropPair(session)
	}
	if err != nil {
		return transfer.Stats{}, err
	}
	return transfer.Stats{Runs: len(runs), Bytes: kvlayout.Bytes(runs)}, nil
}

// GatherSource stages a GPU source's runs in pinned host memory for tcp_shm:
// it returns the bytes and the runs rewritten to read them, and the
// function that frees the staging once they are sent.
func (g *Plane) GatherSource(src hooks.Layout, runs []kvlayout.CopyRun) (host []byte, out []kvlayout.CopyRun, release func(), err error) {
	err = g.withSource(src, func(c *Copier, srcPtrs Regions) error {
		var gerr error
		if host, out, gerr = c.Gather(srcPtrs, runs); gerr != nil {
			c.Close()
			return gerr
		}
		release = c.Close
		return nil
	})
	return host, out, release, err
}

// Gather reads runs of this engine's GPU KV (layout l) into host memory,
// through the session's existing mapping of that memory when there is one
// (the target's, or the source side of a cuda_ipc pair), else through a
// mapping made for the call. It returns the bytes with the runs rewritten
// to read them, and the function that frees them.
func (g *Plane) Gather(session string, l hooks.Layout, runs []kvlayout.CopyRun) ([]byte, []kvlayout.CopyRun, func(), error) {
	g.hashMu.Lock() // until release: the staging is the caller's meanwhile
	g.mu.Lock()
	defer g.mu.Unlock()
	own, err := g.copierFor(l.Regions[0].Memory)
	if err != nil {
		g.hashMu.Unlock()
		return nil, nil, nil, err
	}
	c, err := g.hasher(own.Device)
	if err != nil {
		g.hashMu.Unlock()
		return nil, nil, nil, err
	}
	ptrs, closeView, err := g.viewLocked(session, l, c.Device)
	if err != nil {
		g.hashMu.Unlock()
		return nil, nil, nil, err
	}
	host, out, err := c.Gather(ptrs, runs)
	closeView()
	if err != nil {
		g.hashMu.Unlock()
		return nil, nil, nil, err
	}
	return host, out, g.hashMu.Unlock, nil
}

// viewLocked returns l's regions as addresses in dev's context: the
// session's mapping of that memory when there is one (the target's, or
// the source side of a cuda_ipc pair), else a mapping made for the caller,
// closed by the function returned (g.mu held).
func (g *Plane) viewLocked(session string, l hooks.Layout, dev int) (Regions, func(), error) {
	key := regionsKey(l)
	switch {
	case g.targets[session] != nil && g.targets[session].key == key:
		return g.targets[session].dst, func() {}, nil
	case g.pairs[session] != nil && strings.HasPrefix(g.pairs[session].key, key+"→"):
		return g.pairs[session].src, func() {}, nil
	}
	return openRegions(g.drv, dev, l)
}

// ErrNoSumKernel is returned by KVSum where the driver cannot run the
// integrity check's hash kernel (the caller gathers and hashes on the
// CPU).
var ErrNoSumKernel = errors.New("cuda_ipc: no KV sum kernel")

// KVSum hashes slot ranges of this engine's GPU KV (layout l) in place,
// internal/kvsum's scheme, in one kernel launch on the device that holds
// the first region, reading the regions through the same mappings as
// Gather: tasks makes the kernel's tasks from the regions' addresses
// there. sums gets each range's sum of words (cuda.ErrSumShape or
// ErrNoSumKernel: nothing was read).
func (g *Plane) KVSum(session string, l hooks.Layout, shape cuda.SumShape, tasks func(Regions) []cuda.SumTask, sums []uint64) error {
	g.hashMu.Lock()
	defer g.hashMu.Unlock()
	g.mu.Lock()
	defer g.mu.Unlock()
	own, err := g.copierFor(l.Regions[0].Memory)
	if err != nil {
		return err
	}
	summer, ok := g.drv.(cuda.Summer)
	if !ok {
		return ErrNoSumKernel
	}
	ptrs, closeView, err := g.viewLocked(session, l, own.Device)
	if err != nil {
		return err
	}
	defer closeView()
	return summer.KVSum(own.Device, own.Stream, shape, tasks(ptrs), sums)
}

// checkRuns checks a cuda_ipc round's runs before a kernel executes them:
// every run inside its source and target regions (overflow-safe), every
// copy's blocks inside the engines' pools. The runs come from the Host's
// reservation through kvlayout.Plan, not from a peer, so this is a bound
// on bugs (a write past a region is a write into someone else's GPU
// memory), not the per-block guard the tcp_shm target applies to what
// arrives from the network; it costs a few comparisons per run inside
// the pause.
func checkRuns(src, dst hooks.Layout, copies []kvlayout.BlockCopy, runs []kvlayout.CopyRun) error {
	for _, c := range copies {
		if c.Src < 0 || c.Src >= src.Geometry.NumBlocks || c.Dst < 0 || c.Dst >= dst.Geometry.NumBlocks {
			return fmt.Errorf("cuda_ipc: copy %+v names a block outside the pools (%d, %d blocks)", c, src.Geometry.NumBlocks, dst.Geometry.NumBlocks)
		}
	}
	inside := func(regions []hooks.Region, region int, off, n int64) bool {
		return region >= 0 && region < len(regions) && off >= 0 && n >= 0 && off <= regions[region].Size-n
	}
	for _, r := range runs {
		if !inside(src.Regions, r.SrcRegion, r.SrcOffset, r.Length) || !inside(dst.Regions, r.DstRegion, r.DstOffset, r.Length) {
			return fmt.Errorf("cuda_ipc: run %+v outside the engines' regions", r)
		}
	}
	return nil
}

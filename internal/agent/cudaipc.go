package agent

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// gpuPlane is the agent's CUDA state, made on first use: the driver and a
// stream per device. IPC mappings are opened per copy round and closed at
// its end, so no mapping outlives the round (an engine may free its KV —
// sleep, shutdown — right after a migration).
type gpuPlane struct {
	mu      sync.Mutex
	drv     *cuda.Lib
	streams map[int]cuda.Stream
	// targets are this engine's regions mapped for a migration's tcp_shm
	// writes (GPU KV received over the network), by session.
	targets map[string]*gpuTarget
}

type gpuTarget struct {
	dev   int
	dst   cudaipc.Regions
	sizes []uint64
	close func()
}

// ready loads the driver and makes dev's stream (g.mu held).
func (g *gpuPlane) ready(dev int) (cuda.Stream, error) {
	var err error
	if g.drv == nil {
		if g.drv, err = cuda.Load(); err != nil {
			return 0, fmt.Errorf("GPU KV: %w", err)
		}
		g.streams, g.targets = map[int]cuda.Stream{}, map[string]*gpuTarget{}
	}
	s, ok := g.streams[dev]
	if !ok {
		if s, err = g.drv.NewStream(dev); err != nil {
			return 0, err
		}
		g.streams[dev] = s
	}
	return s, nil
}

// releaseTarget unmaps a session's target regions.
func (g *gpuPlane) releaseTarget(session string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if t := g.targets[session]; t != nil {
		t.close()
		delete(g.targets, session)
	}
}

// sink is a tcp_shm target writing session's data into this engine's GPU
// regions (mapped once per session, staged per connection).
func (g *gpuPlane) sink(session string, l hooks.Layout) (*cudaipc.Sink, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	dev := l.Regions[0].Memory.Device
	s, err := g.ready(dev)
	if err != nil {
		return nil, err
	}
	t := g.targets[session]
	if t == nil {
		dst, closeAll, err := openRegions(g.drv, dev, l)
		if err != nil {
			return nil, err
		}
		t = &gpuTarget{dev: dev, dst: dst, close: closeAll}
		for _, r := range l.Regions {
			t.sizes = append(t.sizes, uint64(r.Size))
		}
		g.targets[session] = t
	}
	return cudaipc.NewSink(&cudaipc.Copier{Driver: g.drv, Device: dev, Stream: s}, t.dst, t.sizes)
}

func (g *gpuPlane) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.drv == nil {
		return
	}
	for _, t := range g.targets {
		t.close()
	}
	for dev, s := range g.streams {
		_ = g.drv.DestroyStream(dev, s)
	}
	g.drv.Close()
	g.drv, g.streams = nil, nil
}

// sameNode reports whether every GPU region of l was exported on this
// machine (regions that do not say are taken as local).
func sameNode(l hooks.Layout) bool {
	here, _ := os.Hostname()
	for _, r := range l.Regions {
		if r.Memory.Kind == hooks.MemoryCUDAIPC && r.Memory.Node != "" && r.Memory.Node != here {
			return false
		}
	}
	return true
}

func onGPU(l hooks.Layout) bool {
	for _, r := range l.Regions {
		if r.Memory.Kind == hooks.MemoryCUDAIPC {
			return true
		}
	}
	return false
}

// pickBackend decides how a round moves bytes: cuda_ipc when both sides'
// KV is in GPU memory on this node (IPC handles only open there), tcp_shm
// otherwise (staged through pinned host memory on a GPU side).
func (a *Agent) pickBackend(src, dst hooks.Layout) (string, error) {
	want := a.cfg.TransferBackend
	sg, dg := onGPU(src), onGPU(dst)
	local := sameNode(src) && sameNode(dst)
	switch {
	case want == "rdma":
		return "", errors.New("the rdma backend is not implemented (no RDMA NIC to build it against)")
	case want == cudaipc.Type && !(sg && dg):
		return "", errors.New("cuda_ipc needs both engines' KV in GPU memory")
	case want == cudaipc.Type && !local:
		return "", errors.New("cuda_ipc needs both engines on this node (CUDA IPC handles do not cross machines)")
	case want == cudaipc.Type || (sg && dg && local && (want == "" || want == "auto")):
		return cudaipc.Type, nil
	default:
		// tcp_shm, staged through pinned host memory on a GPU side.
		return "tcp_shm", nil
	}
}

func memKind(l hooks.Layout) string {
	if onGPU(l) {
		return "GPU"
	}
	return "host"
}

// openRegions maps a layout's regions into dev's context.
func openRegions(drv cuda.Driver, dev int, l hooks.Layout) (cudaipc.Regions, func(), error) {
	var opened []cuda.DevicePtr
	closeAll := func() {
		for _, p := range opened {
			_ = drv.IPCClose(dev, p)
		}
	}
	out := make(cudaipc.Regions, len(l.Regions))
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
			return nil, nil, fmt.Errorf("open region %d (GPU %d) through IPC: %w", i, r.Memory.Device, err)
		}
		opened = append(opened, p)
		out[i] = p + cuda.DevicePtr(r.Memory.Offset)
	}
	return out, closeAll, nil
}

// withSource maps a GPU source's regions on its device and hands fn a
// copier on that device's stream; the mappings close when fn returns.
func (a *Agent) withSource(src hooks.Layout, fn func(c *cudaipc.Copier, srcPtrs cudaipc.Regions) error) error {
	g := &a.gpu
	g.mu.Lock()
	defer g.mu.Unlock()
	dev := src.Regions[0].Memory.Device
	s, err := g.ready(dev)
	if err != nil {
		return err
	}
	srcPtrs, closeSrc, err := openRegions(g.drv, dev, src)
	if err != nil {
		return err
	}
	defer closeSrc()
	return fn(&cudaipc.Copier{Driver: g.drv, Device: dev, Stream: s}, srcPtrs)
}

// cudaCopy runs one round's copies GPU to GPU: the plan's runs, from the
// source engine's regions to the target's, issued from the source GPU.
func (a *Agent) cudaCopy(src, dst hooks.Layout, copies []kvlayout.BlockCopy, fault tcpshm.Fault) (tcpshm.Stats, error) {
	geo := src.Geometry
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(src), specs(dst), copies)
	if err != nil {
		return tcpshm.Stats{}, err
	}
	err = a.withSource(src, func(c *cudaipc.Copier, srcPtrs cudaipc.Regions) error {
		dstPtrs, closeDst, err := openRegions(c.Driver, c.Device, dst)
		if err != nil {
			return err
		}
		defer closeDst()
		if fault != tcpshm.NoFault {
			// Tests of a copy failing halfway: half the runs land, then
			// the round fails and the migration must roll back.
			if err := c.Run(srcPtrs, dstPtrs, runs[:len(runs)/2]); err != nil {
				return err
			}
			return errors.New("cuda_ipc: injected fault: copy failed halfway")
		}
		return c.Run(srcPtrs, dstPtrs, runs)
	})
	if err != nil {
		return tcpshm.Stats{}, err
	}
	return tcpshm.Stats{Runs: len(runs), Bytes: kvlayout.Bytes(runs)}, nil
}

// gatherGPU stages a GPU source's runs in pinned host memory for tcp_shm:
// it returns the bytes and the runs rewritten to read them, and the
// function that frees the staging once they are sent.
func (a *Agent) gatherGPU(src hooks.Layout, runs []kvlayout.CopyRun) (host []byte, out []kvlayout.CopyRun, release func(), err error) {
	err = a.withSource(src, func(c *cudaipc.Copier, srcPtrs cudaipc.Regions) error {
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

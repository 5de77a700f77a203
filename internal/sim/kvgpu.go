package sim

import (
	"errors"
	"fmt"
	"runtime"
	"sync"

	"github.com/cespare/xxhash/v2"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// gpuKV keeps the KV regions in GPU memory (vhi sim --device cuda:N, or
// one GPU per rank: --device cuda:0,cuda:1): one cuMemAlloc per rank ×
// stage, exported to agents as CUDA IPC handles. A step's token writes
// are staged on the host and land with one upload and one scatter-kernel
// launch per GPU; the reads that sampling needs are gathered by one kernel
// launch and one download per GPU. The bytes and the hash order are the
// shm version's, so tokens are the same on CPU and GPU, on one GPU or
// several.
type gpuKV struct {
	drv  *cuda.Lib
	devs []*gpuDev  // one per entry of --device: the ranks' placement
	jobs []tokenJob // this step's token writes
}

// gpuDev is one GPU's share of the KV: its regions and its staging. Each
// has its own stream and buffers, so the GPUs' uploads, scatters and
// gathers overlap.
type gpuDev struct {
	dev     int
	stream  cuda.Stream
	regions []int // indices into kvMemory.regions
	// One token's KV over these regions: its bytes and its slot copies
	// (a step stages tokenBytes and scatters tokenPieces per token).
	tokenBytes, tokenPieces int

	stage  []byte // pinned host memory: this step's token bytes for these regions
	writes []cuda.Copy
	up     cuda.DevicePtr
	upCap  uint64

	gather  []cuda.Copy // Dst: offset into down until run
	pos     int         // bytes gathered so far while planning
	down    cuda.DevicePtr
	downCap uint64
	host    []byte // pinned host memory: the gathered bytes
}

// tokenJob is one token whose KV a step writes.
type tokenJob struct {
	block, slot int
	seed        int64
	token, pos  int
}

// newGPUKVMemory allocates the regions — shard i on devices[i], or all on
// devices[0] — and sizes each GPU's staging for a full step (maxBatched
// tokens written, maxSeqs sampled) up front: pinning a gigabyte of host
// memory takes long enough to stall the first step that needs it, which
// could be a migration target's first step.
func newGPUKVMemory(drv *cuda.Lib, devices []int, geo kvlayout.Geometry, par kvlayout.Parallel, slotMajor bool, maxSeqs, maxBatched int) (*kvMemory, error) {
	if geo.HeadSlotBytes()%16 != 0 {
		return nil, fmt.Errorf("--device cuda needs head_dim × dtype bytes to be a multiple of 16 (it is %d)", geo.HeadSlotBytes())
	}
	shards := regionLayouts(geo, par, slotMajor)
	if len(devices) != 1 && len(devices) != len(shards) {
		return nil, fmt.Errorf("--device lists %d GPUs for %d ranks: give one, or one per rank", len(devices), len(shards))
	}
	g := &gpuKV{drv: drv}
	m := &kvMemory{geo: geo, gpu: g}
	for _, dev := range devices {
		if err := drv.PrepareKernels(dev); err != nil {
			m.close()
			return nil, err
		}
		s, err := drv.NewStream(dev)
		if err != nil {
			m.close()
			return nil, err
		}
		g.devs = append(g.devs, &gpuDev{dev: dev, stream: s})
	}
	for i, l := range shards {
		at := min(i, len(g.devs)-1)
		d := g.devs[at]
		p, err := drv.Alloc(d.dev, uint64(l.Size()))
		if err != nil {
			m.close()
			return nil, fmt.Errorf("allocate %d bytes of KV on GPU %d: %w", l.Size(), d.dev, err)
		}
		d.regions = append(d.regions, len(m.regions))
		d.tokenBytes += l.NumLayers * 2 * l.NumHeads * geo.HeadSlotBytes()
		r := newKVRegion(l)
		r.dptr, r.gpuAt = p, at
		d.tokenPieces += l.NumLayers * 2 * r.headRuns()
		m.regions = append(m.regions, r)
	}
	for _, d := range g.devs {
		up := maxBatched * d.tokenBytes
		// Sampling reads this GPU's share of each block, as its share of a
		// token's bytes.
		down := (maxSeqs*(geo.BlockBytes()+geo.BlockBytes()/sampleGroups)*d.tokenBytes + geo.TokenBytes() - 1) / geo.TokenBytes()
		for _, err := range []error{
			g.pinned(d, &d.stage, up), g.grow(d, &d.up, &d.upCap, uint64(up)),
			g.pinned(d, &d.host, down), g.grow(d, &d.down, &d.downCap, uint64(down)),
		} {
			if err != nil {
				m.close()
				return nil, fmt.Errorf("staging buffers on GPU %d: %w", d.dev, err)
			}
		}
	}
	return m, nil
}

func (g *gpuKV) close(m *kvMemory) {
	for _, r := range m.regions {
		if r.dptr != 0 {
			_ = g.drv.Free(g.devs[r.gpuAt].dev, r.dptr)
		}
	}
	for _, d := range g.devs {
		for _, p := range []cuda.DevicePtr{d.up, d.down} {
			if p != 0 {
				_ = g.drv.Free(d.dev, p)
			}
		}
		_ = g.drv.DestroyStream(d.dev, d.stream)
		if d.stage != nil {
			_ = g.drv.HostFree(d.dev, d.stage[:cap(d.stage)])
		}
		if d.host != nil {
			_ = g.drv.HostFree(d.dev, d.host[:cap(d.host)])
		}
		d.up, d.down, d.stage, d.host = 0, 0, nil, nil
	}
	g.devs = nil
}

// grow makes *p, on d's GPU, hold at least n bytes.
func (g *gpuKV) grow(d *gpuDev, p *cuda.DevicePtr, cap *uint64, n uint64) error {
	if *cap >= n {
		return nil
	}
	if *p != 0 {
		_ = g.drv.Free(d.dev, *p)
		*p, *cap = 0, 0
	}
	c := max(n, 1<<20) * 2
	q, err := g.drv.Alloc(d.dev, c)
	if err != nil {
		return err
	}
	*p, *cap = q, c
	return nil
}

// pinned makes *b a page-locked host buffer of at least n bytes.
func (g *gpuKV) pinned(d *gpuDev, b *[]byte, n int) error {
	if cap(*b) >= n {
		*b = (*b)[:n]
		return nil
	}
	if *b != nil {
		_ = g.drv.HostFree(d.dev, (*b)[:cap(*b)])
		*b = nil
	}
	nb, err := g.drv.HostAlloc(d.dev, uint64(max(n, 1<<20)*2))
	if err != nil {
		return err
	}
	*b = nb[:n]
	return nil
}

// flush generates this step's token KV on the host (in parallel: tokens
// are independent), uploads it and scatters it with one kernel launch per
// GPU; the GPUs work at once, and flush returns when all have finished.
func (g *gpuKV) flush(m *kvMemory) error {
	jobs := g.jobs
	if len(jobs) == 0 {
		return nil
	}
	defer func() { g.jobs = g.jobs[:0] }()
	return g.onEveryGPU(func(d *gpuDev) error { return g.issueWrites(m, d, jobs) })
}

// onEveryGPU enqueues issue's work on every GPU's stream, then waits for
// all of them: the GPUs work at once. A GPU whose issue fails is not
// waited for; every failure is returned.
func (g *gpuKV) onEveryGPU(issue func(d *gpuDev) error) error {
	var errs []error
	issued := make([]bool, len(g.devs))
	for i, d := range g.devs {
		if err := issue(d); err != nil {
			errs = append(errs, fmt.Errorf("GPU %d: %w", d.dev, err))
			continue
		}
		issued[i] = true
	}
	for i, d := range g.devs {
		if issued[i] {
			if err := g.drv.Sync(d.dev, d.stream); err != nil {
				errs = append(errs, fmt.Errorf("GPU %d: %w", d.dev, err))
			}
		}
	}
	return errors.Join(errs...)
}

// issueWrites fills d's staging with the jobs' bytes for d's regions and
// enqueues their upload and scatter on d's stream.
func (g *gpuKV) issueWrites(m *kvMemory, d *gpuDev, jobs []tokenJob) error {
	per, pieces := d.tokenBytes, d.tokenPieces
	if err := g.pinned(d, &d.stage, len(jobs)*per); err != nil {
		return err
	}
	if err := g.grow(d, &d.up, &d.upCap, uint64(len(d.stage))); err != nil {
		return err
	}
	if cap(d.writes) < len(jobs)*pieces {
		d.writes = make([]cuda.Copy, len(jobs)*pieces)
	}
	d.writes = d.writes[:len(jobs)*pieces]
	parallel(len(jobs), func(lo, hi int) {
		for j := lo; j < hi; j++ {
			m.fillToken(d.stage[j*per:(j+1)*per], d.writes[j*pieces:(j+1)*pieces], d.up+cuda.DevicePtr(j*per), jobs[j], d.regions)
		}
	})
	if err := g.drv.HtoDAsync(d.dev, d.stream, d.up, d.stage); err != nil {
		return err
	}
	return g.drv.KernelCopy(d.dev, d.stream, d.writes)
}

// fillToken writes one token's KV bytes in the listed regions — the same
// words, in the same (region, layer, K/V, head) order, as writeToken does
// in a file — into out, and the copies that put them in place into cs.
func (m *kvMemory) fillToken(out []byte, cs []cuda.Copy, src cuda.DevicePtr, j tokenJob, regions []int) {
	k := tokenKey(j.seed, j.token, j.pos)
	at, n := 0, 0
	for _, i := range regions {
		r := &m.regions[i]
		l := &r.layout
		base := j.block*r.blockStride + j.slot*r.slotStride
		// A slot-major region holds the token's heads side by side, as
		// they are staged: one copy for each layer's K or V.
		runs := r.headRuns()
		runLen := l.NumHeads / runs * r.slotBytes
		for layer := 0; layer < l.NumLayers; layer++ {
			for kv := 0; kv < 2; kv++ {
				off := layer*r.layerStride + kv*r.kvStride + base
				for h := 0; h < l.NumHeads; h++ {
					gl, gh := l.FirstLayer+layer, l.FirstHead+h
					fillSlot(out[at+h*r.slotBytes:at+(h+1)*r.slotBytes], k, gl, kv, gh)
				}
				for h := 0; h < runs; h++ {
					cs[n] = cuda.Copy{Dst: r.dptr + cuda.DevicePtr(off), Src: src + cuda.DevicePtr(at), Len: uint64(runLen)}
					at += runLen
					n++
					off += r.headStride
				}
			}
		}
	}
}

// headRuns is how many runs one token's heads of one layer's K or V make
// in r: one per head where heads are a block's slowest dimension (HND),
// one where a slot's heads are side by side (NHD).
func (r *kvRegion) headRuns() int {
	if r.headStride == r.slotBytes {
		return 1
	}
	return r.layout.NumHeads
}

// parallel runs f over [0, n) in up to GOMAXPROCS chunks.
func parallel(n int, f func(lo, hi int)) {
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		f(0, n)
		return
	}
	var wg sync.WaitGroup
	for i := 0; i < w; i++ {
		lo, hi := i*n/w, (i+1)*n/w
		wg.Add(1)
		go func() { defer wg.Done(); f(lo, hi) }()
	}
	wg.Wait()
}

// planReader records the reads a hash needs, each on the GPU that holds
// its region (returning nothing: hashSlots does not hash while planning);
// replayReader then hands out the gathered bytes in the same order.
type planReader struct {
	m *kvMemory
}

func (p *planReader) read(region, off, n int) []byte {
	r := &p.m.regions[region]
	d := p.m.gpu.devs[r.gpuAt]
	d.gather = append(d.gather, cuda.Copy{Src: r.dptr + cuda.DevicePtr(off), Dst: cuda.DevicePtr(d.pos), Len: uint64(n)})
	d.pos += n
	return nil
}

// replayReader reads a request's gathered bytes: pos[i] is where the next
// read from the GPU devs[i] starts in that GPU's download.
type replayReader struct {
	m   *kvMemory
	pos []int
}

func (r *replayReader) read(region, _, n int) []byte {
	i := r.m.regions[region].gpuAt
	b := r.m.gpu.devs[i].host[r.pos[i] : r.pos[i]+n]
	r.pos[i] += n
	return b
}

// sampleSums computes each request's sampling hash (see Engine.sample):
// on files by reading them in place, on GPUs with one gather per GPU.
func (m *kvMemory) sampleSums(reqs []*request, hash func(d *xxhash.Digest, rd kvReader, r *request)) ([]uint64, error) {
	sums := make([]uint64, len(reqs))
	var d xxhash.Digest
	if m.gpu == nil {
		for i, r := range reqs {
			d.Reset()
			hash(&d, hostReader{m}, r)
			sums[i] = d.Sum64()
		}
		return sums, nil
	}
	g := m.gpu
	for _, gd := range g.devs {
		gd.gather, gd.pos = gd.gather[:0], 0
	}
	plan := &planReader{m: m}
	starts := make([][]int, len(reqs)) // per request, where its bytes start on each GPU
	for i, r := range reqs {
		starts[i] = make([]int, len(g.devs))
		for k, gd := range g.devs {
			starts[i][k] = gd.pos
		}
		hash(&d, plan, r)
	}
	if err := g.download(); err != nil {
		return nil, err
	}
	// Each request's bytes start where its plan started: hash them in
	// parallel, each with its own digest.
	parallel(len(reqs), func(lo, hi int) {
		var d xxhash.Digest
		for i := lo; i < hi; i++ {
			d.Reset()
			hash(&d, &replayReader{m: m, pos: starts[i]}, reqs[i])
			sums[i] = d.Sum64()
		}
	})
	return sums, nil
}

// download runs every GPU's planned gather and brings the bytes to its
// pinned host buffer; the GPUs work at once.
func (g *gpuKV) download() error {
	return g.onEveryGPU(g.issueGather)
}

// issueGather enqueues d's planned gather and its download (nothing when
// no read was planned on d).
func (g *gpuKV) issueGather(d *gpuDev) error {
	if d.pos == 0 {
		return nil
	}
	if err := g.grow(d, &d.down, &d.downCap, uint64(d.pos)); err != nil {
		return err
	}
	for i := range d.gather {
		d.gather[i].Dst += d.down
	}
	if err := g.drv.KernelCopy(d.dev, d.stream, d.gather); err != nil {
		return err
	}
	if err := g.pinned(d, &d.host, d.pos); err != nil {
		return err
	}
	return g.drv.DtoHAsync(d.dev, d.stream, d.host, d.down)
}

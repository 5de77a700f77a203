package sim

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/cespare/xxhash/v2"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// gpuKV keeps the KV regions in GPU memory (vhi sim --device cuda:N): one
// cuMemAlloc per rank × stage, exported to agents as CUDA IPC handles.
// A step's token writes are staged on the host and land with one upload
// and one scatter-kernel launch; the reads that sampling needs are
// gathered by one kernel launch and one download. The bytes and the hash
// order are the shm version's, so tokens are the same on CPU and GPU.
type gpuKV struct {
	drv    *cuda.Lib
	dev    int
	stream cuda.Stream

	jobs   []tokenJob // this step's token writes
	stage  []byte     // pinned host memory: their bytes
	writes []cuda.Copy
	up     cuda.DevicePtr
	upCap  uint64

	gather  []cuda.Copy // Dst: offset into down until run
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

// newGPUKVMemory allocates the regions, and sizes the staging buffers for
// a full step (maxBatched tokens written, maxSeqs sampled) up front:
// pinning a gigabyte of host memory takes long enough to stall the first
// step that needs it, which could be a migration target's first step.
func newGPUKVMemory(drv *cuda.Lib, dev int, geo kvlayout.Geometry, par kvlayout.Parallel, maxSeqs, maxBatched int) (*kvMemory, error) {
	if geo.HeadSlotBytes()%16 != 0 {
		return nil, fmt.Errorf("--device cuda needs head_dim × dtype bytes to be a multiple of 16 (it is %d)", geo.HeadSlotBytes())
	}
	if err := drv.PrepareKernels(dev); err != nil {
		return nil, err
	}
	s, err := drv.NewStream(dev)
	if err != nil {
		return nil, err
	}
	g := &gpuKV{drv: drv, dev: dev, stream: s}
	m := &kvMemory{geo: geo, gpu: g}
	for _, sh := range par.Shards() {
		l := kvlayout.NewRegionLayout(geo, sh)
		p, err := drv.Alloc(dev, uint64(l.Size()))
		if err != nil {
			m.close()
			return nil, fmt.Errorf("allocate %d bytes of KV on GPU %d: %w", l.Size(), dev, err)
		}
		m.regions = append(m.regions, kvRegion{
			layout: l, dptr: p,
			layerStride: int(l.LayerStride()), kvStride: int(l.KVStride()), blockStride: int(l.BlockStride()),
			headStride: int(l.HeadStride()), slotBytes: geo.HeadSlotBytes(),
		})
	}
	up := maxBatched * geo.TokenBytes()
	down := maxSeqs * (geo.BlockBytes() + geo.BlockBytes()/sampleGroups)
	for _, err := range []error{
		g.pinned(&g.stage, up), g.grow(&g.up, &g.upCap, uint64(up)),
		g.pinned(&g.host, down), g.grow(&g.down, &g.downCap, uint64(down)),
	} {
		if err != nil {
			m.close()
			return nil, fmt.Errorf("staging buffers on GPU %d: %w", dev, err)
		}
	}
	return m, nil
}

func (g *gpuKV) close(m *kvMemory) {
	for _, r := range m.regions {
		if r.dptr != 0 {
			_ = g.drv.Free(g.dev, r.dptr)
		}
	}
	for _, p := range []cuda.DevicePtr{g.up, g.down} {
		if p != 0 {
			_ = g.drv.Free(g.dev, p)
		}
	}
	_ = g.drv.DestroyStream(g.dev, g.stream)
	_ = g.drv.HostFree(g.dev, g.stage)
	_ = g.drv.HostFree(g.dev, g.host)
	g.up, g.down, g.stage, g.host = 0, 0, nil, nil
}

// grow makes *p hold at least n bytes.
func (g *gpuKV) grow(p *cuda.DevicePtr, cap *uint64, n uint64) error {
	if *cap >= n {
		return nil
	}
	if *p != 0 {
		_ = g.drv.Free(g.dev, *p)
		*p, *cap = 0, 0
	}
	c := max(n, 1<<20) * 2
	q, err := g.drv.Alloc(g.dev, c)
	if err != nil {
		return err
	}
	*p, *cap = q, c
	return nil
}

// pinned makes *b a page-locked host buffer of at least n bytes.
func (g *gpuKV) pinned(b *[]byte, n int) error {
	if cap(*b) >= n {
		*b = (*b)[:n]
		return nil
	}
	if *b != nil {
		_ = g.drv.HostFree(g.dev, (*b)[:cap(*b)])
		*b = nil
	}
	nb, err := g.drv.HostAlloc(g.dev, uint64(max(n, 1<<20)*2))
	if err != nil {
		return err
	}
	*b = nb[:n]
	return nil
}

// flush generates this step's token KV on the host (in parallel: tokens
// are independent), uploads it and scatters it with one kernel launch.
func (g *gpuKV) flush(m *kvMemory) error {
	jobs := g.jobs
	if len(jobs) == 0 {
		return nil
	}
	defer func() { g.jobs = g.jobs[:0] }()
	per := 0 // bytes and slot copies of one token, over every region
	pieces := 0
	for _, r := range m.regions {
		per += r.layout.NumLayers * 2 * r.layout.NumHeads * r.slotBytes
		pieces += r.layout.NumLayers * 2 * r.layout.NumHeads
	}
	if err := g.pinned(&g.stage, len(jobs)*per); err != nil {
		return err
	}
	if err := g.grow(&g.up, &g.upCap, uint64(len(g.stage))); err != nil {
		return err
	}
	if cap(g.writes) < len(jobs)*pieces {
		g.writes = make([]cuda.Copy, len(jobs)*pieces)
	}
	g.writes = g.writes[:len(jobs)*pieces]
	parallel(len(jobs), func(lo, hi int) {
		for j := lo; j < hi; j++ {
			m.fillToken(g.stage[j*per:(j+1)*per], g.writes[j*pieces:(j+1)*pieces], g.up+cuda.DevicePtr(j*per), jobs[j])
		}
	})
	if err := g.drv.HtoDAsync(g.dev, g.stream, g.up, g.stage); err != nil {
		return err
	}
	if err := g.drv.KernelCopy(g.dev, g.stream, g.writes); err != nil {
		return err
	}
	return g.drv.Sync(g.dev, g.stream)
}

// fillToken writes one token's KV bytes — the same words, in the same
// (region, layer, K/V, head) order, as writeToken does in a file — into
// out, and the copies that put them in place into cs.
func (m *kvMemory) fillToken(out []byte, cs []cuda.Copy, src cuda.DevicePtr, j tokenJob) {
	k := tokenKey(j.seed, j.token, j.pos)
	at, n := 0, 0
	for i := range m.regions {
		r := &m.regions[i]
		l := &r.layout
		base := j.block*r.blockStride + j.slot*r.slotBytes
		for layer := 0; layer < l.NumLayers; layer++ {
			for kv := 0; kv < 2; kv++ {
				off := layer*r.layerStride + kv*r.kvStride + base
				for h := 0; h < l.NumHeads; h++ {
					dst := out[at : at+r.slotBytes]
					gl, gh := l.FirstLayer+layer, l.FirstHead+h
					fillSlot(dst, k, gl, kv, gh)
					cs[n] = cuda.Copy{Dst: r.dptr + cuda.DevicePtr(off), Src: src + cuda.DevicePtr(at), Len: uint64(r.slotBytes)}
					at += r.slotBytes
					n++
					off += r.headStride
				}
			}
		}
	}
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

// planReader records the reads a hash needs (returning nothing: hashSlots
// does not hash while planning); replay then hands out the gathered bytes
// in the same order.
type planReader struct {
	m   *kvMemory
	pos int
}

func (p *planReader) read(region, off, n int) []byte {
	g := p.m.gpu
	g.gather = append(g.gather, cuda.Copy{Src: p.m.regions[region].dptr + cuda.DevicePtr(off), Dst: cuda.DevicePtr(p.pos), Len: uint64(n)})
	p.pos += n
	return nil
}

type replayReader struct {
	buf []byte
	pos int
}

func (r *replayReader) read(_, _, n int) []byte {
	b := r.buf[r.pos : r.pos+n]
	r.pos += n
	return b
}

// sampleSums computes each request's sampling hash (see Engine.sample):
// on files by reading them in place, on the GPU with one gather.
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
	plan := &planReader{m: m}
	g.gather = g.gather[:0]
	starts := make([]int, len(reqs))
	for i, r := range reqs {
		starts[i] = plan.pos
		hash(&d, plan, r)
	}
	if plan.pos > 0 {
		if err := g.grow(&g.down, &g.downCap, uint64(plan.pos)); err != nil {
			return nil, err
		}
		for i := range g.gather {
			g.gather[i].Dst += g.down
		}
		if err := g.drv.KernelCopy(g.dev, g.stream, g.gather); err != nil {
			return nil, err
		}
		if err := g.pinned(&g.host, plan.pos); err != nil {
			return nil, err
		}
		if err := g.drv.DtoHAsync(g.dev, g.stream, g.host, g.down); err != nil {
			return nil, err
		}
		if err := g.drv.Sync(g.dev, g.stream); err != nil {
			return nil, err
		}
	}
	// Each request's bytes start where its plan started: hash them in
	// parallel, each with its own digest.
	parallel(len(reqs), func(lo, hi int) {
		var d xxhash.Digest
		for i := lo; i < hi; i++ {
			d.Reset()
			hash(&d, &replayReader{buf: g.host, pos: starts[i]}, reqs[i])
			sums[i] = d.Sum64()
		}
	})
	return sums, nil
}

package sim

import (
	"fmt"

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

	stage  []byte      // host: this step's written slot bytes
	writes []cuda.Copy // Src: offset into stage until flush
	up     cuda.DevicePtr
	upCap  uint64

	gather  []cuda.Copy // Dst: offset into down until run
	down    cuda.DevicePtr
	downCap uint64
	host    []byte
}

func newGPUKVMemory(drv *cuda.Lib, dev int, geo kvlayout.Geometry, par kvlayout.Parallel) (*kvMemory, error) {
	if geo.HeadSlotBytes()%16 != 0 {
		return nil, fmt.Errorf("--device cuda needs head_dim × dtype bytes to be a multiple of 16 (it is %d)", geo.HeadSlotBytes())
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
	g.up, g.down = 0, 0
}

func (g *gpuKV) stageWrite(base cuda.DevicePtr, off, n int) []byte {
	at := len(g.stage)
	g.stage = append(g.stage, make([]byte, n)...)
	g.writes = append(g.writes, cuda.Copy{Dst: base + cuda.DevicePtr(off), Src: cuda.DevicePtr(at), Len: uint64(n)})
	return g.stage[at : at+n]
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

func (g *gpuKV) flush() error {
	if len(g.writes) == 0 {
		return nil
	}
	defer func() { g.stage, g.writes = g.stage[:0], g.writes[:0] }()
	if err := g.grow(&g.up, &g.upCap, uint64(len(g.stage))); err != nil {
		return err
	}
	if err := g.drv.HtoD(g.dev, g.up, g.stage); err != nil {
		return err
	}
	for i := range g.writes {
		g.writes[i].Src += g.up
	}
	if err := g.drv.KernelCopy(g.dev, g.stream, g.writes); err != nil {
		return err
	}
	return g.drv.Sync(g.dev, g.stream)
}

// planReader records the reads a hash needs (returning zeros); replay
// then hands out the gathered bytes in the same order.
type planReader struct {
	m   *kvMemory
	pos int
}

func (p *planReader) read(region, off, n int) []byte {
	g := p.m.gpu
	g.gather = append(g.gather, cuda.Copy{Src: p.m.regions[region].dptr + cuda.DevicePtr(off), Dst: cuda.DevicePtr(p.pos), Len: uint64(n)})
	p.pos += n
	return zeros[:n:n]
}

// zeros backs planning reads (never hashed for real).
var zeros = make([]byte, 1<<22)

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
	for _, r := range reqs {
		d.Reset()
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
		if err := g.drv.Sync(g.dev, g.stream); err != nil {
			return nil, err
		}
		if cap(g.host) < plan.pos {
			g.host = make([]byte, plan.pos)
		}
		g.host = g.host[:plan.pos]
		if err := g.drv.DtoH(g.dev, g.host, g.down); err != nil {
			return nil, err
		}
	}
	rep := &replayReader{buf: g.host}
	for i, r := range reqs {
		d.Reset()
		hash(&d, rep, r)
		sums[i] = d.Sum64()
	}
	return sums, nil
}

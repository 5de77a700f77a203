package cuda

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/kvsum"
)

// sumLayout is a test engine's KV: layers × [K/V, blocks, slots, heads,
// head slot] per region (vLLM's flash-attention layout), its heads split
// over two regions (two allocations, as a TP2 engine's workers hold them).
type sumLayout struct {
	layers, heads, words, slots, blocks int
	regions                             int // the heads are split evenly
}

func (g sumLayout) hsb() int            { return 8 * g.words }
func (g sumLayout) regionHeads() int    { return g.heads / g.regions }
func (g sumLayout) slotStride() uint64  { return uint64(g.regionHeads() * g.hsb()) }
func (g sumLayout) blockStride() uint64 { return uint64(g.slots) * g.slotStride() }
func (g sumLayout) kvStride() uint64    { return uint64(g.blocks) * g.blockStride() }
func (g sumLayout) layerStride() uint64 { return 2 * g.kvStride() }
func (g sumLayout) regionBytes() uint64 { return uint64(g.layers) * g.layerStride() }
func (g sumLayout) offset(l, kv, h, b, s int) uint64 {
	return uint64(l)*g.layerStride() + uint64(kv)*g.kvStride() + uint64(b)*g.blockStride() + uint64(s)*g.slotStride() + uint64(h%g.regionHeads())*uint64(g.hsb())
}

// want is a block's slot range hashed on the CPU, walking the canonical
// order over the host copies of the regions.
func (g sumLayout) want(host [][]byte, b, first, n int) uint64 {
	var sum, i uint64
	for l := range g.layers {
		for kv := range 2 {
			for h := range g.heads {
				for s := first; s < first+n; s++ {
					off := g.offset(l, kv, h, b, s)
					sum = kvsum.Add(sum, host[h/g.regionHeads()][off:off+uint64(g.hsb())], i)
					i += uint64(g.words)
				}
			}
		}
	}
	return kvsum.Finish(sum, i)
}

func (g sumLayout) tasks(ptrs []DevicePtr, b, first, n, out int) []SumTask {
	var ts []SumTask
	for r, p := range ptrs {
		ts = append(ts, SumTask{
			Base: p + DevicePtr(uint64(b)*g.blockStride()+uint64(first)*g.slotStride()), LayerStride: g.layerStride(),
			KVStride: g.kvStride(), HeadStride: uint64(g.hsb()), SlotStride: g.slotStride(),
			FirstLayer: 0, NumLayers: uint32(g.layers), FirstHead: uint32(r * g.regionHeads()), NumHeads: uint32(g.regionHeads()),
			Slots: uint32(n), Out: uint32(out),
		})
	}
	return ts
}

// The kernel's sums are the CPU's, block by block and slot range by slot
// range, for heads spread over two regions; a byte changed on the device
// changes its block's sum alone.
func TestKVSumOnTheGPUIsTheCPUs(t *testing.T) {
	l := loadOrSkip(t)
	if n, err := l.DeviceCount(); err != nil || n == 0 {
		t.Skip("no device: ", err)
	}
	g := sumLayout{layers: 3, heads: 4, words: 32, slots: 16, blocks: 24, regions: 2}
	rng := rand.New(rand.NewPCG(3, 4))
	host := make([][]byte, g.regions)
	ptrs := make([]DevicePtr, g.regions)
	for r := range host {
		host[r] = make([]byte, g.regionBytes())
		for i := range host[r] {
			host[r][i] = byte(rng.Uint32())
		}
		p, err := l.Alloc(0, g.regionBytes())
		if err != nil {
			t.Fatal(err)
		}
		defer l.Free(0, p)
		if err := l.HtoD(0, p, host[r]); err != nil {
			t.Fatal(err)
		}
		ptrs[r] = p
	}
	s, err := l.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.DestroyStream(0, s)
	type rng3 struct{ block, first, n int }
	ranges := []rng3{{0, 0, 16}, {5, 3, 9}, {23, 15, 1}, {7, 0, 0}, {11, 0, 16}}
	var tasks []SumTask
	for i, r := range ranges {
		if r.n > 0 {
			tasks = append(tasks, g.tasks(ptrs, r.block, r.first, r.n, i)...)
		}
	}
	shape := SumShape{KVHeads: uint32(g.heads), Words: uint32(g.words)}
	sums := make([]uint64, len(ranges))
	check := func(what string) {
		t.Helper()
		if err := l.KVSum(0, s, shape, tasks, sums); err != nil {
			t.Fatal(what, err)
		}
		for i, r := range ranges {
			words := uint64(g.layers * 2 * g.heads * r.n * g.words)
			if got, want := kvsum.Finish(sums[i], words), g.want(host, r.block, r.first, r.n); got != want {
				t.Fatalf("%s: block %d slots %d+%d: the GPU's hash %#x, the CPU's %#x", what, r.block, r.first, r.n, got, want)
			}
		}
	}
	check("as written")
	// One byte of block 5's slot 4, layer 2, V, head 3 (the second region).
	off := g.offset(2, 1, 3, 5, 4) + 17
	host[1][off] ^= 0x40
	if err := l.HtoD(0, ptrs[1]+DevicePtr(off), host[1][off:off+1]); err != nil {
		t.Fatal(err)
	}
	before := append([]uint64(nil), sums...)
	check("after a byte changed")
	for i := range ranges {
		if changed := sums[i] != before[i]; changed != (i == 1) {
			t.Fatalf("range %d changed: %v", i, changed)
		}
	}
	bad := append([]SumTask(nil), tasks[0])
	bad[0].Base += 8
	if err := l.KVSum(0, s, shape, bad, sums); err != ErrSumShape {
		t.Fatalf("an unaligned task: %v", err)
	}
}

// The kernel at a final round's size at the Qwen3-8B geometry (36 layers,
// 8 KV heads, 128 × bf16 a head's slot, 16-slot blocks): its time is
// logged, for docs/benchmarks.md (the check in the pause reads this much
// on each side).
func TestKVSumAtAFinalRoundsSize(t *testing.T) {
	l := loadOrSkip(t)
	if n, err := l.DeviceCount(); err != nil || n == 0 {
		t.Skip("no device: ", err)
	}
	g := sumLayout{layers: 36, heads: 8, words: 32, slots: 16, blocks: 2048, regions: 1}
	p, err := l.Alloc(0, g.regionBytes())
	if err != nil {
		t.Fatal(err)
	}
	defer l.Free(0, p)
	s, err := l.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.DestroyStream(0, s)
	rng := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{557, 2048} {
		var tasks []SumTask
		for i, b := range rng.Perm(g.blocks)[:n] {
			tasks = append(tasks, g.tasks([]DevicePtr{p}, b, 0, g.slots, i)...)
		}
		sums := make([]uint64, n)
		shape := SumShape{KVHeads: uint32(g.heads), Words: uint32(g.words)}
		if err := l.KVSum(0, s, shape, tasks, sums); err != nil { // the kernel's load
			t.Fatal(err)
		}
		best := time.Hour
		for range 5 {
			start := time.Now()
			if err := l.KVSum(0, s, shape, tasks, sums); err != nil {
				t.Fatal(err)
			}
			best = min(best, time.Since(start))
		}
		bytes := float64(n) * float64(g.blockStride()) * float64(2*g.layers)
		t.Logf("%d whole blocks, %.0f MB: %v (%.0f GB/s), upload and download included", n, bytes/1e6, best, bytes/best.Seconds()/1e9)
	}
}

package kvlayout

import "testing"

// BenchmarkPlanFinalRound plans a final round's token slots: one slot in
// each of 256 blocks, the default sim geometry (36 layers × 8 heads), in
// the sim's head-major layout (a run per head) and vLLM's slot-major one
// (a run per layer and K/V).
func BenchmarkPlanFinalRound(b *testing.B) {
	p, _ := LookupProfile("qwen3-8b")
	g, _ := p.Scaled(32, 16, 32768)
	var copies []BlockCopy
	for i := 0; i < 256; i++ {
		copies = append(copies, BlockCopy{Src: 1 + i*7, Dst: 2 + i*5, FirstSlot: 3, NumSlots: 1})
	}
	for _, c := range []struct {
		name      string
		slotMajor bool
		runs      int
	}{{"HND", false, 256 * 576}, {"NHD", true, 256 * 72}} {
		r := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1})
		r.SlotMajor = c.slotMajor
		spec := r.Spec()
		b.Run(c.name, func(b *testing.B) {
			for b.Loop() {
				runs, _ := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{spec}, []RegionSpec{spec}, copies)
				if len(runs) != c.runs {
					b.Fatal(len(runs))
				}
			}
		})
	}
}

package kvlayout

import "testing"

// BenchmarkPlanFinalRound plans a final round's token slots: one slot in
// each of 256 blocks, the default sim geometry (36 layers × 8 heads).
func BenchmarkPlanFinalRound(b *testing.B) {
	p, _ := LookupProfile("qwen3-8b")
	g, _ := p.Scaled(32, 16, 32768)
	r := NewRegionLayout(g, Shard{TPSize: 1, PPSize: 1}).Spec()
	var copies []BlockCopy
	for i := 0; i < 256; i++ {
		copies = append(copies, BlockCopy{Src: 1 + i*7, Dst: 2 + i*5, FirstSlot: 3, NumSlots: 1})
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		runs, _ := Plan(g.Layers, g.KVHeads, int64(g.HeadSlotBytes()), []RegionSpec{r}, []RegionSpec{r}, copies)
		if len(runs) != 256*576 {
			b.Fatal(len(runs))
		}
	}
}

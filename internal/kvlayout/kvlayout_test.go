package kvlayout

import (
	"testing"
)

func TestProfileSizes(t *testing.T) {
	p, err := LookupProfile("qwen3-8b")
	if err != nil {
		t.Fatal(err)
	}
	full, err := p.Scaled(1, 16, 100)
	if err != nil {
		t.Fatal(err)
	}
	// The anchors: a Qwen3-8B token is 144 KiB, a 16-token block 2.36 MB.
	if full.TokenBytes() != 144*1024 || full.BlockBytes() != 2359296 {
		t.Fatalf("qwen3-8b: token %d, block %d", full.TokenBytes(), full.BlockBytes())
	}
	scaled, _ := p.Scaled(32, 16, 100)
	if scaled.TokenBytes() != 4608 {
		t.Fatalf("scale 32: token %d bytes, want 4608", scaled.TokenBytes())
	}
	if _, err := p.Scaled(3, 16, 100); err == nil {
		t.Fatal("a scale that does not divide head dim was accepted")
	}
	if _, err := LookupProfile("nope"); err == nil {
		t.Fatal("unknown profile accepted")
	}
}

func TestLayerRange(t *testing.T) {
	for _, c := range []struct{ layers, pp int }{{36, 1}, {36, 2}, {36, 5}, {4, 4}, {7, 3}} {
		next := 0
		for s := 0; s < c.pp; s++ {
			first, end := LayerRange(c.layers, c.pp, s)
			if first != next || end <= first {
				t.Fatalf("%d layers / pp %d: stage %d is [%d,%d)", c.layers, c.pp, s, first, end)
			}
			next = end
		}
		if next != c.layers {
			t.Fatalf("%d layers / pp %d: covered %d", c.layers, c.pp, next)
		}
	}
}

// Every (layer, K/V, head, block, slot) of the model lives in exactly one
// byte range of exactly one shard, for any TP×PP, and the shards' sizes add
// up to the model's KV.
func TestShardsPartitionTheModel(t *testing.T) {
	g := Geometry{Layers: 6, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 4, NumBlocks: 5}
	for _, par := range []Parallel{{TP: 1, PP: 1}, {TP: 2, PP: 1}, {TP: 4, PP: 1}, {TP: 1, PP: 2}, {TP: 2, PP: 3}, {TP: 4, PP: 6}} {
		if err := par.Validate(g); err != nil {
			t.Fatal(err)
		}
		type key struct{ l, kv, h, b, s int }
		seen := map[key]bool{}
		var total int64
		for _, sh := range Shards(par) {
			r := NewRegionLayout(g, sh)
			total += r.Size()
			used := make([]bool, r.Size())
			for v := range vectors(r.NumLayers, g.NumBlocks, r.NumHeads, g.BlockSize) {
				k := key{r.FirstLayer + v.l, v.kv, r.FirstHead + v.h, v.b, v.s}
				if seen[k] {
					t.Fatalf("%+v: %+v in two shards", par, k)
				}
				seen[k] = true
				off := r.Offset(v.l, v.kv, v.b, v.h, v.s)
				for i := off; i < off+int64(g.HeadSlotBytes()); i++ {
					if used[i] {
						t.Fatalf("%+v: byte %d used twice", par, i)
					}
					used[i] = true
				}
			}
		}
		if want := int64(g.BlockBytes()) * int64(g.NumBlocks); total != want {
			t.Fatalf("%+v: shards hold %d bytes, model has %d", par, total, want)
		}
		if len(seen) != g.Layers*2*g.KVHeads*g.NumBlocks*g.BlockSize {
			t.Fatalf("%+v: covered %d slots", par, len(seen))
		}
	}
	if (Parallel{TP: 3, PP: 1}).Validate(g) == nil {
		t.Fatal("tp 3 with 4 heads accepted")
	}
}

func TestRuns(t *testing.T) {
	g := Geometry{Layers: 4, KVHeads: 8, HeadDim: 4, DTypeBytes: 2, BlockSize: 16, NumBlocks: 10}
	r := NewRegionLayout(g, Shard{TPRank: 1, TPSize: 2, PPSize: 2, PPStage: 1})
	runs := r.BlockRuns(3)
	if len(runs) != 2*r.NumLayers {
		t.Fatalf("%d runs", len(runs))
	}
	var sum int64
	for _, x := range runs {
		sum += x.Length
	}
	if sum != r.BlockBytes() {
		t.Fatalf("block runs cover %d bytes, block is %d", sum, r.BlockBytes())
	}
	slots := r.SlotRuns(3, 5, 2)
	if len(slots) != 2*r.NumLayers*r.NumHeads || slots[0].Length != 2*int64(g.HeadSlotBytes()) {
		t.Fatalf("slot runs %+v", slots[:1])
	}
	if slots[0].Offset != r.Offset(0, 0, 3, 0, 5) {
		t.Fatal("first slot run offset")
	}
}

// Both layouts place every (layer, K/V, block, head, slot) once inside the
// region, and a block's slot runs cover exactly those slots' bytes.
func TestHeadMajorAndSlotMajorLayouts(t *testing.T) {
	g := Geometry{Layers: 3, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 4, NumBlocks: 5}
	hsb := int64(g.HeadSlotBytes())
	for _, slotMajor := range []bool{false, true} {
		r := NewRegionLayout(g, Shard{TPSize: 2, TPRank: 1, PPSize: 1})
		r.SlotMajor = slotMajor
		seen := map[int64]bool{}
		for l := 0; l < r.NumLayers; l++ {
			for kv := 0; kv < 2; kv++ {
				for b := 0; b < g.NumBlocks; b++ {
					for h := 0; h < r.NumHeads; h++ {
						for s := 0; s < g.BlockSize; s++ {
							o := r.Offset(l, kv, b, h, s)
							if o < 0 || o+hsb > r.Size() || o%hsb != 0 || seen[o] {
								t.Fatalf("%s: (%d,%d,%d,%d,%d) at %d: outside, unaligned or taken", r.Name(), l, kv, b, h, s, o)
							}
							seen[o] = true
						}
					}
				}
			}
		}
		if int64(len(seen))*hsb != r.Size() {
			t.Fatalf("%s: %d slots of %d bytes in a region of %d", r.Name(), len(seen), hsb, r.Size())
		}
		if slotMajor && r.Offset(0, 0, 2, 1, 3)-r.Offset(0, 0, 2, 0, 3) != hsb {
			t.Fatal("NHD: a slot's heads are not side by side")
		}
		want := map[int64]bool{}
		for l := 0; l < r.NumLayers; l++ {
			for kv := 0; kv < 2; kv++ {
				for h := 0; h < r.NumHeads; h++ {
					for s := 1; s < 3; s++ {
						want[r.Offset(l, kv, 2, h, s)] = true
					}
				}
			}
		}
		runs := r.SlotRuns(2, 1, 2)
		if n := 2 * r.NumLayers; slotMajor && len(runs) != n {
			t.Fatalf("NHD: %d slot runs, want one per layer and K/V (%d)", len(runs), n)
		}
		for _, run := range runs {
			for o := run.Offset; o < run.Offset+run.Length; o += hsb {
				if !want[o] {
					t.Fatalf("%s: slot run %+v covers %d, not one of the slots", r.Name(), run, o)
				}
				delete(want, o)
			}
		}
		if len(want) != 0 {
			t.Fatalf("%s: %d slots not covered by the slot runs", r.Name(), len(want))
		}
	}
}

package tcpshm

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

func memoryOf(g kvlayout.Geometry, p kvlayout.Parallel, fill bool) *Memory {
	m := &Memory{Layers: g.Layers, Heads: g.KVHeads, SlotBytes: int64(g.HeadSlotBytes())}
	rng := rand.New(rand.NewPCG(7, 9))
	for _, sh := range p.Shards() {
		r := kvlayout.NewRegionLayout(g, sh)
		b := make([]byte, r.Size())
		if fill {
			for i := range b {
				b[i] = byte(rng.IntN(256))
			}
		}
		m.Data = append(m.Data, b)
		m.Specs = append(m.Specs, r.Spec())
	}
	return m
}

// readSlot returns the bytes of (layer, kv, head, block, slot) wherever the
// layout keeps them.
func readSlot(m *Memory, l, kv, h, b, s int) []byte {
	for i, r := range m.Specs {
		if l >= r.FirstLayer && l < r.FirstLayer+r.NumLayers && h >= r.FirstHead && h < r.FirstHead+r.NumHeads {
			st := r.Strides
			off := int64(l-r.FirstLayer)*st.Layer + int64(kv)*st.KV + int64(b)*st.Block + int64(h-r.FirstHead)*st.Head + int64(s)*st.Slot
			return m.Data[i][off : off+m.SlotBytes]
		}
	}
	panic("not held")
}

// Runs and slot jobs both land exactly, across TP shapes, over several
// connections; a corrupted frame is reported and a cut connection fails.
func TestSendRunsAndSlots(t *testing.T) {
	g := kvlayout.Geometry{Layers: 4, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 8, NumBlocks: 32}
	src := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, true)
	for _, dp := range []kvlayout.Parallel{{TP: 1, PP: 1}, {TP: 2, PP: 2}} {
		for _, slots := range []bool{false, true} {
			t.Run(fmt.Sprintf("tp%d-pp%d-slots=%v", dp.TP, dp.PP, slots), func(t *testing.T) {
				dst := memoryOf(g, dp, false)
				srv, err := Listen("127.0.0.1:0", func(s string) (*Memory, error) {
					if s != "mig-1" {
						return nil, fmt.Errorf("unexpected session %q", s)
					}
					return dst, nil
				}, zap.NewNop())
				if err != nil {
					t.Fatal(err)
				}
				defer srv.Close()
				copies := []kvlayout.BlockCopy{{Src: 3, Dst: 5, FirstSlot: 2, NumSlots: 3}, {Src: 4, Dst: 6, NumSlots: 8}, {Src: 9, Dst: 1, FirstSlot: 7, NumSlots: 1}}
				if slots {
					_, err = SendSlots(context.Background(), srv.Addr().String(), "mig-1", 3, src, copies, NoFault)
				} else {
					runs, perr := kvlayout.Plan(g.Layers, g.KVHeads, src.SlotBytes, src.Specs, dst.Specs, copies)
					if perr != nil {
						t.Fatal(perr)
					}
					_, err = Send(context.Background(), srv.Addr().String(), "mig-1", 3, src.Data, runs, NoFault)
				}
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range copies {
					for l := 0; l < g.Layers; l++ {
						for kv := 0; kv < 2; kv++ {
							for h := 0; h < g.KVHeads; h++ {
								for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
									if !bytes.Equal(readSlot(dst, l, kv, h, c.Dst, s), readSlot(src, l, kv, h, c.Src, s)) {
										t.Fatalf("layer %d kv %d head %d block %d slot %d differs", l, kv, h, c.Dst, s)
									}
								}
							}
						}
					}
				}
				// Faults are detected, never silently accepted.
				if _, err := SendSlots(context.Background(), srv.Addr().String(), "mig-1", 1, src, copies, CorruptFrame); err == nil {
					t.Fatal("a corrupted frame was accepted")
				}
				if _, err := SendSlots(context.Background(), srv.Addr().String(), "mig-1", 1, src, copies, CutConn); err == nil {
					t.Fatal("a cut connection reported success")
				}
				if _, err := SendSlots(context.Background(), srv.Addr().String(), "other", 1, src, copies, NoFault); err == nil {
					t.Fatal("an unexpected session was accepted")
				}
			})
		}
	}
}

package tcpshm

import (
	"context"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// The final round of vhi bench migrate's default load: 256 sequences'
// last token slots (about one each, some two) at Qwen3-8B's geometry with
// the sim's --kv-scale 32 (576 places of 8 B per slot).
func BenchmarkSendSlotsFinalRound(b *testing.B) {
	g := kvlayout.Geometry{Layers: 36, KVHeads: 8, HeadDim: 4, DTypeBytes: 2, BlockSize: 16, NumBlocks: 4096}
	src := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, true)
	dst := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, false)
	var jobs []kvlayout.BlockCopy
	var blocks []int
	for i := range 305 {
		n := 1
		if i%6 == 0 {
			n = 2
		}
		jobs = append(jobs, kvlayout.BlockCopy{Src: 1 + i*3, Dst: 2 + i*3, FirstSlot: 14 - n + 1, NumSlots: n})
		blocks = append(blocks, 2+i*3)
	}
	dst.Guard = guard(b, g, dst, blocks...)
	srv := serveMemory(b, dst, time.Now().Add(time.Hour), Options{})
	b.ResetTimer()
	for range b.N {
		if _, err := SendSlots(context.Background(), dest(srv), 2, src, jobs, transfer.NoFault); err != nil {
			b.Fatal(err)
		}
	}
}

package sim

import (
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
)

// BenchmarkDecodeStep measures the real compute of one decode step of 256
// sequences on the default geometry (qwen3-8b at kv-scale 32), the cost the
// sim adds on top of its modelled step time.
func BenchmarkDecodeStep(b *testing.B) {
	c := DefaultConfig()
	c.ShmDir = "/dev/shm"
	c.ShmPrefix = "bench"
	c.NumBlocks = 256*80 + 16
	e, err := NewEngine(c, zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	for i := 0; i < 256; i++ {
		p := greedy(1 << 20 / 1024)
		p.MaxTokens = 4000
		if err := e.Submit(NewRequest{ID: fmt.Sprint(i), Prompt: prompt(600, i), Params: p, SeedSet: true}); err != nil {
			b.Fatal(err)
		}
	}
	e.lock()
	defer e.mu.Unlock()
	for len(e.waiting) > 0 || e.running[0].numComputed < len(e.running[0].prompt) {
		e.step(time.Now())
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		e.step(time.Now())
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/step")
}

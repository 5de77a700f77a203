package bench

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

func TestTokenRateAndTaskTime(t *testing.T) {
	t0 := time.Unix(100, 0)
	at := func(ms ...int) []time.Time {
		var out []time.Time
		for _, m := range ms {
			out = append(out, t0.Add(time.Duration(m)*time.Millisecond))
		}
		return out
	}
	streams := []loadgen.Stream{
		{Start: t0, Arrivals: at(100, 200, 300)},
		{Start: t0.Add(50 * time.Millisecond), Arrivals: at(260, 900)},
	}
	r := rateOf(streams, 250*time.Millisecond)
	// Bins [0,250): 2 tokens, [250,500): 2, [500,750): 0, [750,1000): 1.
	want := []float64{8, 8, 0, 4}
	if len(r.Rate) != len(want) {
		t.Fatalf("rate %v, want %v", r.Rate, want)
	}
	for i := range want {
		if r.Rate[i] != want[i] {
			t.Fatalf("rate %v, want %v", r.Rate, want)
		}
	}
	if got := taskTime(streams); got != 0.9 {
		t.Fatalf("task time %v, want 0.9", got)
	}
}

// A small run of two rows writes the tables, a JSON and a plot per row,
// and every stream is exact.
func TestBenchSeedWritesTablesAndPlots(t *testing.T) {
	if testing.Short() {
		t.Skip("runs migrations")
	}
	out := t.TempDir()
	f := seedFlags{out: out, fullStreams: 8, fullTokens: 200, fullDelay: 300 * time.Millisecond, singleTokens: 300,
		singleDelay: 300 * time.Millisecond, rows: []string{"full/a1_bpp", "single/atp_b1"}, deviceA: "cpu", deviceB: "cpu", granular: "slot"}
	if err := runBenchSeed(context.Background(), io.Discard, zap.NewNop(), f, simGeometryFlags{numBlocks: 2048}); err != nil {
		t.Fatal(err)
	}
	md, err := os.ReadFile(filepath.Join(out, "seed.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"| a1_bpp | tp1pp1 | tp1pp2 |", "| atp_b1 | tp2pp1 | tp1pp1 |", "8/8", "1/1", "0.879, 10, 17705, 38.90", "full_a1_bpp.png"} {
		if !strings.Contains(string(md), want) {
			t.Errorf("seed.md lacks %q:\n%s", want, md)
		}
	}
	for _, name := range []string{"full_a1_bpp", "single_atp_b1"} {
		b, err := os.ReadFile(filepath.Join(out, name+".json"))
		if err != nil {
			t.Fatal(err)
		}
		var r seedResult
		if err := json.Unmarshal(b, &r); err != nil || r.Status.Migrated == 0 || len(r.Rate.Rate) == 0 || len(r.BaseRate.Rate) == 0 {
			t.Fatalf("%s: %v %+v", name, err, r.Status)
		}
		png, err := os.ReadFile(filepath.Join(out, name+".png"))
		if err != nil || len(png) < 1000 || string(png[1:4]) != "PNG" {
			t.Fatalf("%s.png: %v (%d bytes)", name, err, len(png))
		}
	}
	if err := runBenchSeed(context.Background(), io.Discard, zap.NewNop(), seedFlags{rows: []string{"full/a9"}, granular: "slot"}, simGeometryFlags{}); err == nil ||
		!strings.Contains(err.Error(), "full/a1_btp") {
		t.Fatalf("an unknown row: %v", err)
	}
}

package bench

import (
	"fmt"
	"image/color"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// seedPublished are the seed's own figures (3 × RTX PRO 6000 Blackwell,
// Qwen3-8B, real vLLM), to print beside ours: downtime (s), rounds, KV
// blocks, GB.
var seedPublished = map[string][4]float64{
	"full/a1_b1": {1.147, 9, 10040, 22.06}, "full/a1_btp": {1.597, 9, 17839, 39.20}, "full/a1_bpp": {0.879, 10, 17705, 38.90},
	"single/a1_b1": {0.084, 3, 260, 0.57}, "single/a1_btp": {0.116, 3, 337, 0.74}, "single/a1_bpp": {0.091, 3, 280, 0.62},
	"single/atp_b1": {0.114, 4, 377, 0.83}, "single/app_b1": {0.087, 3, 255, 0.56},
}

// rateBin is the token-rate series' bin.
const rateBin = 250 * time.Millisecond

// tokenRate is the clients' tokens per second over time, in bins from the
// first request's start.
type tokenRate struct {
	BinS float64   `json:"bin_s"`
	Rate []float64 `json:"tokens_per_s"`
}

func firstStart(streams []loadgen.Stream) time.Time {
	var t0 time.Time
	for _, s := range streams {
		if t0.IsZero() || (!s.Start.IsZero() && s.Start.Before(t0)) {
			t0 = s.Start
		}
	}
	return t0
}

// taskTime is first request sent → last token received.
func taskTime(streams []loadgen.Stream) float64 {
	t0 := firstStart(streams)
	var end time.Time
	for _, s := range streams {
		if n := len(s.Arrivals); n > 0 && s.Arrivals[n-1].After(end) {
			end = s.Arrivals[n-1]
		}
	}
	if t0.IsZero() || end.IsZero() {
		return 0
	}
	return end.Sub(t0).Seconds()
}

func rateOf(streams []loadgen.Stream, bin time.Duration) tokenRate {
	t0 := firstStart(streams)
	r := tokenRate{BinS: bin.Seconds()}
	for _, s := range streams {
		for _, a := range s.Arrivals {
			i := int(a.Sub(t0) / bin)
			if i < 0 {
				continue
			}
			for len(r.Rate) <= i {
				r.Rate = append(r.Rate, 0)
			}
			r.Rate[i]++
		}
	}
	for i := range r.Rate {
		r.Rate[i] /= bin.Seconds()
	}
	return r
}

func (r tokenRate) points() plotter.XYs {
	pts := make(plotter.XYs, len(r.Rate))
	for i, v := range r.Rate {
		pts[i].X, pts[i].Y = (float64(i)+0.5)*r.BinS, v
	}
	return pts
}

// plotTokenRate draws the clients' token rate of the migrated run and of
// its baseline, with the migration's span shaded.
func plotTokenRate(path string, r seedResult) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("%s/%s: client token rate (%d × %d tokens)", r.Load, r.Row, r.Streams, r.MaxTokens)
	p.X.Label.Text = "seconds since the first request"
	p.Y.Label.Text = "tokens/s (all clients)"
	p.Add(plotter.NewGrid())
	if r.MigrationEndS > r.MigrationStartS {
		top := 0.0
		for _, v := range append(append([]float64(nil), r.Rate.Rate...), r.BaseRate.Rate...) {
			top = max(top, v)
		}
		span, err := plotter.NewPolygon(plotter.XYs{{X: r.MigrationStartS, Y: 0}, {X: r.MigrationEndS, Y: 0},
			{X: r.MigrationEndS, Y: top * 1.05}, {X: r.MigrationStartS, Y: top * 1.05}})
		if err != nil {
			return err
		}
		span.Color = color.NRGBA{R: 255, G: 170, B: 60, A: 70}
		span.LineStyle.Width = 0
		span.LineStyle.Color = color.Transparent
		p.Add(span)
		p.Legend.Add("migration (request → done)", span)
	}
	base, err := plotter.NewLine(r.BaseRate.points())
	if err != nil {
		return err
	}
	base.Color = color.RGBA{R: 120, G: 120, B: 120, A: 255}
	base.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	mig, err := plotter.NewLine(r.Rate.points())
	if err != nil {
		return err
	}
	mig.Color = color.RGBA{R: 30, G: 90, B: 200, A: 255}
	mig.Width = vg.Points(1.5)
	p.Add(base, mig)
	p.Legend.Add("baseline (no migration)", base)
	p.Legend.Add("migrated A→B", mig)
	p.Legend.Top = false // the curves run along the top
	p.Legend.YOffs = vg.Points(8)
	p.Y.Min = 0
	return p.Save(8*vg.Inch, 4*vg.Inch, path)
}

// seedTables is seed.md: the seed's two tables per load with ours and
// the seed's published figures side by side, then the per-round blocks.
func seedTables(results []seedResult, f seedFlags, cfg sim.Config) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# vhi bench seed — %s\n\n", time.Now().UTC().Format("2006-01-02"))
	fmt.Fprintf(&b, "vhi sim: profile %s, kv-scale %d, %d blocks, KV on %s → %s, final round in %ss. "+
		"The seed: 3 × RTX PRO 6000 Blackwell, real vLLM, Qwen3-8B, LongWriter prompts.\n\n",
		cfg.Profile, cfg.KVScale, cfg.NumBlocks, f.deviceA, f.deviceB, f.granular)
	for _, load := range []string{"full", "single"} {
		var rows []seedResult
		for _, r := range results {
			if r.Load == load {
				rows = append(rows, r)
			}
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(&b, "## %s (%d × %d tokens)\n\n", map[string]string{"full": "Full load", "single": "Single long sequence"}[load],
			rows[0].Streams, rows[0].MaxTokens)
		b.WriteString("| tag | A | B | downtime (s) | client max gap (s) | rounds | KV blocks | data (GB) | final / round 0 | streams exact | task time vs baseline (s) | seed: downtime, rounds, blocks, GB |\n")
		b.WriteString("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
		for _, r := range rows {
			st := r.Status
			var blocks int
			var bytes, r0, final int64
			for _, rd := range st.Rounds {
				blocks += rd.BlockCount
				bytes += rd.Bytes
				switch rd.Kind {
				case "full":
					r0 = rd.Bytes
				case "final":
					final = rd.Bytes
				}
			}
			pct := "—"
			if r0 > 0 {
				pct = fmt.Sprintf("%.2f %%", 100*float64(final)/float64(r0))
			}
			seed := "—"
			if s, ok := seedPublished[r.Load+"/"+r.Row]; ok {
				seed = fmt.Sprintf("%.3f, %.0f, %.0f, %.2f", s[0], s[1], s[2], s[3])
			}
			fmt.Fprintf(&b, "| %s | %s | %s | %.4f | %.4f | %d | %d | %.3f | %s | %d/%d | %+.2f (%.2f vs %.2f) | %s |\n",
				r.Row, r.A, r.B, st.DowntimeS, r.MaxGapS, len(st.Rounds), blocks,
				float64(bytes)/1e9, pct, r.Exact, r.Streams, r.TaskS-r.BaseTaskS, r.TaskS, r.BaseTaskS, seed)
		}
		b.WriteString("\nKV blocks / GB per round:\n\n| tag | rounds |\n| --- | --- |\n")
		for _, r := range rows {
			var parts []string
			for _, rd := range r.Status.Rounds {
				parts = append(parts, fmt.Sprintf("%s %d / %.3f", rd.Kind, rd.BlockCount, float64(rd.Bytes)/1e9))
			}
			fmt.Fprintf(&b, "| %s | %s |\n", r.Row, strings.Join(parts, " · "))
		}
		b.WriteString("\n")
		for _, r := range rows {
			fmt.Fprintf(&b, "![%s/%s](%s_%s.png)\n", r.Load, r.Row, r.Load, r.Row)
		}
		b.WriteString("\n")
	}
	return b.String()
}

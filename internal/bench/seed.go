package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// seedRow is one row of the seed's tables: a load and the shapes of A and B.
type seedRow struct {
	Name   string            // the seed's name for it (a1_btp: A at TP1, B at TP2)
	Single bool              // one long sequence instead of the full load
	A, B   kvlayout.Parallel // TP×PP
}

// seedRows are the seed's eight rows: three at full load, five single
// sequences (scale-out and scale-in over TP and PP).
var seedRows = []seedRow{
	{Name: "a1_b1", A: kvlayout.Parallel{TP: 1, PP: 1}, B: kvlayout.Parallel{TP: 1, PP: 1}},
	{Name: "a1_btp", A: kvlayout.Parallel{TP: 1, PP: 1}, B: kvlayout.Parallel{TP: 2, PP: 1}},
	{Name: "a1_bpp", A: kvlayout.Parallel{TP: 1, PP: 1}, B: kvlayout.Parallel{TP: 1, PP: 2}},
	{Name: "a1_b1", Single: true, A: kvlayout.Parallel{TP: 1, PP: 1}, B: kvlayout.Parallel{TP: 1, PP: 1}},
	{Name: "a1_btp", Single: true, A: kvlayout.Parallel{TP: 1, PP: 1}, B: kvlayout.Parallel{TP: 2, PP: 1}},
	{Name: "a1_bpp", Single: true, A: kvlayout.Parallel{TP: 1, PP: 1}, B: kvlayout.Parallel{TP: 1, PP: 2}},
	{Name: "atp_b1", Single: true, A: kvlayout.Parallel{TP: 2, PP: 1}, B: kvlayout.Parallel{TP: 1, PP: 1}},
	{Name: "app_b1", Single: true, A: kvlayout.Parallel{TP: 1, PP: 2}, B: kvlayout.Parallel{TP: 1, PP: 1}},
}

func (r seedRow) load() string {
	if r.Single {
		return "single"
	}
	return "full"
}

// seedFlags size the two loads.
type seedFlags struct {
	out                        string
	fullStreams, fullTokens    int
	singleTokens               int
	fullDelay, singleDelay     time.Duration
	rows                       []string
	deviceA, deviceB, granular string
}

func newBenchSeedCommand(g *Options) *cobra.Command {
	var f seedFlags
	var geo simGeometryFlags
	cmd := &cobra.Command{
		Use:   "seed",
		Short: "Reproduce the seed's tables and token-rate figures on vhi sim",
		Long: `Runs the seed's eight migrations on vhi sim — full load (--full-streams × --full-max-tokens)
A→B with B at the same shape, TP2 and PP2 (a1_b1, a1_btp, a1_bpp), and one long sequence
(--single-max-tokens) for those three and the scale-ins TP2→TP1 and PP2→PP1 (atp_b1,
app_b1) — each beside its no-migration baseline (the same load on a lone sim). Writes to --out:
seed.md (the seed-style tables: downtime, rounds, KV blocks and GB, per round; every stream
checked against the baseline; total task time against the baseline), ROW.json (the
migration's status and the token-rate series) and ROW.png (the clients' token rate over time,
baseline beside it).`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			return runBenchSeed(cmd.Context(), cmd.OutOrStdout(), log, f, geo)
		}),
	}
	fl := cmd.Flags()
	fl.StringVar(&f.out, "out", "seed-bench", "directory for seed.md, ROW.json and ROW.png")
	fl.IntVar(&f.fullStreams, "full-streams", 256, "streams of the full-load rows")
	fl.IntVar(&f.fullTokens, "full-max-tokens", 1024, "tokens per stream of the full-load rows")
	fl.IntVar(&f.singleTokens, "single-max-tokens", 8192, "tokens of the single sequence")
	fl.DurationVar(&f.fullDelay, "full-delay", 10*time.Second, "load start → migration, full load")
	fl.DurationVar(&f.singleDelay, "single-delay", 30*time.Second, "load start → migration, single sequence")
	fl.StringSliceVar(&f.rows, "rows", nil, "run only these rows (full/a1_b1, single/atp_b1, …; default all eight)")
	fl.StringVar(&f.deviceA, "device-a", "cpu", "sim A's KV (and the baseline's): cpu or cuda[:N], or GPUs to spread its ranks over (cuda:0,cuda:1)")
	fl.StringVar(&f.deviceB, "device-b", "cpu", "sim B's KV: cpu or cuda[:N], or GPUs to spread its ranks over (cuda:0,cuda:1)")
	fl.StringVar(&f.granular, "final-granularity", "slot", "final-round granularity: slot or block")
	geo.register(fl)
	return cmd
}

// seedResult is one row's outcome, as ROW.json holds it.
type seedResult struct {
	Row        string                  `json:"row"`
	Load       string                  `json:"load"`
	A          string                  `json:"a"` // the source's shape, tp1pp1
	B          string                  `json:"b"`
	Streams    int                     `json:"streams"`
	MaxTokens  int                     `json:"max_tokens"`
	Status     hostapi.MigrationStatus `json:"status"`
	Exact      int                     `json:"exact_streams"`
	Mismatches []string                `json:"mismatches,omitempty"`
	TaskS      float64                 `json:"task_time_s"`
	BaseTaskS  float64                 `json:"baseline_task_time_s"`
	MaxGapS    float64                 `json:"client_max_gap_during_migration_s"`
	MedianGapS float64                 `json:"client_median_gap_s"`
	Rate       tokenRate               `json:"token_rate"`
	BaseRate   tokenRate               `json:"baseline_token_rate"`
	// The migration's start and end on the run's clock (seconds since the
	// first request was sent).
	MigrationStartS float64 `json:"migration_start_s"`
	MigrationEndS   float64 `json:"migration_end_s"`
}

func runBenchSeed(ctx context.Context, out io.Writer, log *zap.Logger, f seedFlags, geo simGeometryFlags) error {
	want := map[string]bool{}
	for _, r := range f.rows {
		want[r] = true
	}
	var rows []seedRow
	unknown := map[string]bool{}
	for k := range want {
		unknown[k] = true
	}
	for _, r := range seedRows {
		if len(want) == 0 || want[r.load()+"/"+r.Name] {
			rows = append(rows, r)
			delete(unknown, r.load()+"/"+r.Name)
		}
	}
	if len(unknown) > 0 {
		var names []string
		for _, r := range seedRows {
			names = append(names, r.load()+"/"+r.Name)
		}
		return fmt.Errorf("--rows: unknown %v (the rows: %s)", slices.Sorted(maps.Keys(unknown)), strings.Join(names, ", "))
	}
	if f.granular != "slot" && f.granular != "block" {
		return fmt.Errorf("--final-granularity %q: slot or block", f.granular)
	}
	if err := os.MkdirAll(f.out, 0o755); err != nil {
		return err
	}
	cfg := sim.DefaultConfig()
	geo.apply(&cfg)
	var results []seedResult
	for _, r := range rows {
		sc := scenario{Streams: f.fullStreams, MaxTokens: f.fullTokens, PromptWords: 200, Sim: cfg, Delay: f.fullDelay,
			DeviceA: f.deviceA, DeviceB: f.deviceB, ShapeA: r.A, ShapeB: r.B, Type: hostapi.DestroySource,
			FinalGranularity: f.granular, TN: 2, Log: log}
		if r.Single {
			sc.Streams, sc.MaxTokens, sc.Delay = 1, f.singleTokens, f.singleDelay
			// Room for the prompt beside the whole output.
			sc.Sim.MaxModelLen = max(sc.Sim.MaxModelLen, f.singleTokens+2048)
		}
		fmt.Fprintf(out, "%s/%s: %d × %d tokens, A TP%d×PP%d → B TP%d×PP%d …\n", r.load(), r.Name, sc.Streams, sc.MaxTokens,
			r.A.TP, r.A.PP, r.B.TP, r.B.PP)
		res, err := sc.run(ctx)
		if err != nil {
			return fmt.Errorf("%s/%s: %w", r.load(), r.Name, err)
		}
		sr := summarize(r, sc, res)
		results = append(results, sr)
		name := r.load() + "_" + r.Name
		b, _ := json.MarshalIndent(sr, "", "  ")
		if err := os.WriteFile(filepath.Join(f.out, name+".json"), b, 0o644); err != nil {
			return err
		}
		if err := plotTokenRate(filepath.Join(f.out, name+".png"), sr); err != nil {
			return fmt.Errorf("plot %s: %w", name, err)
		}
	}
	md := seedTables(results, f, cfg)
	if err := os.WriteFile(filepath.Join(f.out, "seed.md"), []byte(md), 0o644); err != nil {
		return err
	}
	fmt.Fprint(out, "\n", md)
	for _, r := range results {
		if r.Status.State != hostapi.StateSucceeded || len(r.Mismatches) > 0 || r.Status.Migrated == 0 {
			first := ""
			if len(r.Mismatches) > 0 {
				first = ": " + r.Mismatches[0]
			}
			return fmt.Errorf("%s/%s: migration %s, %d of %d requests moved, %d mismatches%s",
				r.Load, r.Row, r.Status.State, r.Status.Migrated, r.Status.Requests, len(r.Mismatches), first)
		}
	}
	return nil
}

// shapeName is the seed's spelling of a shape: tp2pp1.
func shapeName(p kvlayout.Parallel) string { return fmt.Sprintf("tp%dpp%d", p.TP, p.PP) }

func summarize(r seedRow, sc scenario, res scenarioResult) seedResult {
	origin := firstStart(res.Streams)
	sr := seedResult{Row: r.Name, Load: r.load(), A: shapeName(r.A), B: shapeName(r.B), Streams: sc.Streams, MaxTokens: sc.MaxTokens, Status: res.Status,
		Exact: len(res.Streams) - len(res.Mismatches), Mismatches: res.Mismatches,
		TaskS: taskTime(res.Streams), BaseTaskS: taskTime(res.Reference),
		MaxGapS: res.MaxGapDuringMigration.Seconds(), MedianGapS: res.MedianGap.Seconds(),
		Rate: rateOf(res.Streams, rateBin), BaseRate: rateOf(res.Reference, rateBin),
		MigrationStartS: res.MigrationStart.Sub(origin).Seconds()}
	if !res.Status.FinishedAt.IsZero() {
		sr.MigrationEndS = res.Status.FinishedAt.Sub(origin).Seconds()
	}
	return sr
}

package cli

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// inProcessSim is a sim engine and its HTTP server on a loopback port.
type inProcessSim struct {
	URL  string
	Eng  *sim.Engine
	stop func()
}

func startInProcessSim(cfg sim.Config, log *zap.Logger) (*inProcessSim, error) {
	eng, err := sim.NewEngine(cfg, log)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		eng.Close()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	engDone := make(chan struct{})
	go func() { defer close(engDone); eng.Run(ctx) }()
	srv := newHTTPServer(sim.NewServer(eng, log).Handler())
	go func() { _ = srv.Serve(ln) }()
	return &inProcessSim{
		URL: "http://" + ln.Addr().String(), Eng: eng,
		stop: func() {
			_ = srv.Close()
			cancel()
			<-engDone
			eng.Close()
		},
	}, nil
}

func newDemoCommand(g *globalFlags) *cobra.Command {
	var streams, maxTokens int
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the sim under a streaming load and check every stream is reproducible",
		Long: `vhi demo starts two vhi sim engines on loopback (A, and B with a KV cache small
enough to force preemption), streams the same requests through both in
different batch orders, and checks every stream is identical token for token:
the oracle the migration tests rely on. Exit status 0 only if all match.

(Until hot migration lands, this is the demo; it then becomes Host + A + B +
agents with a migration mid-stream.)`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger()
			if err != nil {
				return err
			}
			return runDemo(cmd.Context(), cmd.OutOrStdout(), log, streams, maxTokens)
		},
	}
	cmd.Flags().IntVar(&streams, "streams", 48, "concurrent streams")
	cmd.Flags().IntVar(&maxTokens, "max-tokens", 160, "longest output per stream")
	return cmd
}

func demoRequests(n, maxTokens int) []loadgen.Request {
	words := []string{"hello", "world", "model", "token", "stream", "water", "story", "house", "light", "earth"}
	reqs := make([]loadgen.Request, n)
	for i := range reqs {
		prompt := fmt.Sprintf("request %d:", i)
		for j := 0; j < 8+(i*37)%120; j++ {
			prompt += " " + words[(i*7+j*3)%len(words)]
		}
		seed := int64(1000 + i)
		reqs[i] = loadgen.Request{Prompt: prompt, MaxTokens: maxTokens/2 + (i*53)%(maxTokens/2+1), IgnoreEOS: i%4 != 0}
		if i%2 == 0 {
			reqs[i].Seed, reqs[i].Temperature = &seed, 0.8
		}
	}
	return reqs
}

func runDemo(ctx context.Context, out io.Writer, log *zap.Logger, n, maxTokens int) error {
	if n < 1 || maxTokens < 2 {
		return fmt.Errorf("need --streams ≥ 1 and --max-tokens ≥ 2")
	}
	cfgA := sim.DefaultConfig()
	cfgA.Model, cfgA.ShmPrefix = "demo-model", fmt.Sprintf("vhi-demo-%d-a", os.Getpid())
	cfgA.NumBlocks, cfgA.MaxModelLen = 4096, 1024
	cfgB := cfgA
	cfgB.ShmPrefix = fmt.Sprintf("vhi-demo-%d-b", os.Getpid())
	// B gets room for about a third of the load at once: it must preempt.
	cfgB.NumBlocks = max(n*(maxTokens+160)/16/5, (cfgB.MaxModelLen+15)/16+2)
	a, err := startInProcessSim(cfgA, log)
	if err != nil {
		return fmt.Errorf("start sim A: %w", err)
	}
	defer a.stop()
	b, err := startInProcessSim(cfgB, log)
	if err != nil {
		return fmt.Errorf("start sim B: %w", err)
	}
	defer b.stop()

	reqs := demoRequests(n, maxTokens)
	fmt.Fprintf(out, "vhi demo: %d streams on sim A (all at once), then on sim B (reverse order, staggered, %d KV blocks)\n", n, cfgB.NumBlocks)
	t0 := time.Now()
	onA := loadgen.Run(ctx, loadgen.Config{BaseURL: a.URL, Model: cfgA.Model}, reqs)
	wallA := time.Since(t0)
	rev := make([]loadgen.Request, n)
	for i := range reqs {
		rev[n-1-i] = reqs[i]
	}
	t1 := time.Now()
	onBrev := loadgen.Run(ctx, loadgen.Config{BaseURL: b.URL, Model: cfgA.Model, Stagger: 2 * time.Second}, rev)
	wallB := time.Since(t1)
	onB := make([]loadgen.Stream, n)
	for i := range onBrev {
		onB[n-1-i] = onBrev[i]
	}
	statsB, _ := b.Eng.Stats(ctx)
	preemptions := b.Eng.Preemptions()

	mismatches := 0
	for i := range reqs {
		switch {
		case onA[i].Err != nil:
			mismatches++
			fmt.Fprintf(out, "  stream %d on A failed: %v\n", i, onA[i].Err)
		case onB[i].Err != nil:
			mismatches++
			fmt.Fprintf(out, "  stream %d on B failed: %v\n", i, onB[i].Err)
		case onA[i].Text != onB[i].Text:
			mismatches++
			fmt.Fprintf(out, "  stream %d differs: A %q… B %q…\n", i, head(onA[i].Text), head(onB[i].Text))
		}
	}
	sa, sb := loadgen.Summarize(onA, wallA), loadgen.Summarize(onB, wallB)
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "run\tstreams\ttokens\twall\ttok/s\tTTFT p50\tgap p50\tgap p99\tpreemptions")
	fmt.Fprintf(tw, "A\t%d\t%d\t%.1fs\t%.0f\t%v\t%v\t%v\t%d\n", sa.Streams, sa.Tokens, wallA.Seconds(), sa.TokensPerSec, sa.TTFTp50.Round(time.Millisecond), sa.GapP50.Round(time.Millisecond), sa.GapP99.Round(time.Millisecond), a.Eng.Preemptions())
	fmt.Fprintf(tw, "B\t%d\t%d\t%.1fs\t%.0f\t%v\t%v\t%v\t%d\n", sb.Streams, sb.Tokens, wallB.Seconds(), sb.TokensPerSec, sb.TTFTp50.Round(time.Millisecond), sb.GapP50.Round(time.Millisecond), sb.GapP99.Round(time.Millisecond), preemptions)
	_ = tw.Flush()
	fmt.Fprintf(out, "sample output (stream 0): %q\n", head(onA[0].Text))
	fmt.Fprintf(out, "B free blocks after the run: %d of %d\n", statsB.FreeBlocks, statsB.TotalBlocks)
	if mismatches > 0 {
		return exitError{code: 1, err: fmt.Errorf("%d of %d streams differ between A and B", mismatches, n)}
	}
	fmt.Fprintf(out, "OK: all %d streams identical token for token across instances, batch orders and preemption\n", n)
	return nil
}

func head(s string) string {
	if len(s) > 60 {
		return s[:60]
	}
	return s
}

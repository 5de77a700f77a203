package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/rebalance"
)

// rebalanceBench is vhi bench rebalance's own settings.
type rebalanceBench struct {
	opsBench
	shortTokens int
	stagger     time.Duration
	policy      rebalance.Config
}

func newBenchRebalanceCommand(g *Options) *cobra.Command {
	b := rebalanceBench{policy: rebalance.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "rebalance",
		Short: "Head-of-line blocking on a skewed load: short requests' TTFT with the rebalancing policy off and on",
		Long: `Starts a Host with two active sims of one model in this process (--max-num-seqs seats
each) and sends --streams requests over --stagger in a repeating pattern of six — long,
short, long, short, short, short — that the Host's round robin deals unevenly: one engine
gets every long request (--max-tokens) and a third of its requests are short (--short-tokens),
the other gets only short ones. Once the long ones fill the first engine's seats its short
ones wait behind them. The same load runs twice on fresh deployments, the policy off and on
(--rebalance-* as the Host's flags); the report gives the short requests' TTFT (p50, p99, max),
the long ones' completion time, the balancer's decisions, and checks that every stream of the
run with the policy on equals the same stream with it off.`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			b.log = log
			if b.policy.Interval <= 0 {
				return fmt.Errorf("--rebalance-interval %v must be positive", b.policy.Interval)
			}
			if err := b.policy.Check(); err != nil {
				return err
			}
			if b.streams < 6 || b.shortTokens < 1 {
				return fmt.Errorf("--streams ≥ 6 (one pattern) and --short-tokens ≥ 1")
			}
			return runBenchRebalance(cmd.Context(), cmd.OutOrStdout(), b)
		}),
	}
	f := cmd.Flags()
	b.register(f, 96, 600, 0)
	_ = f.MarkHidden("delay")
	f.IntVar(&b.shortTokens, "short-tokens", 16, "tokens of a short request")
	f.DurationVar(&b.stagger, "stagger", 2*time.Second, "the requests' arrivals spread over this long")
	f.DurationVar(&b.policy.Interval, "rebalance-interval", 200*time.Millisecond, "the balancer's interval in the run with the policy on")
	f.IntVar(&b.policy.WaitingHigh, "rebalance-waiting", 0, "overloaded: more waiting requests than this")
	f.Float64Var(&b.policy.KVHigh, "rebalance-kv-high", b.policy.KVHigh, "overloaded: KV use at least this")
	f.Float64Var(&b.policy.Spread, "rebalance-kv-spread", b.policy.Spread, "even out two instances whose KV use differs by more")
	f.IntVar(&b.policy.MaxRequests, "rebalance-max-requests", 8, "longest sequences moved per decision")
	f.DurationVar(&b.policy.Cooldown, "rebalance-cooldown", time.Second, "an instance's rest after a decision")
	// Few seats, so that the long requests fill them on this machine.
	b.geo.maxNumSeqs = 16
	f.Lookup("max-num-seqs").DefValue = "16"
	return cmd
}

// longAt says whether request i of the pattern is a long one: round robin
// over two engines deals positions 0, 2 and 4 of every six to one of them.
func longAt(i int) bool { return i%6 == 0 || i%6 == 2 }

func (b rebalanceBench) load() []loadgen.Request {
	reqs := b.requests()
	for i := range reqs {
		if !longAt(i) {
			reqs[i].MaxTokens = b.shortTokens
		}
	}
	return reqs
}

// rebalanceRun is one run's figures.
type rebalanceRun struct {
	streams   []loadgen.Stream
	shortTTFT []time.Duration
	longDone  []time.Duration
	decisions int
	moves     int
}

func runBenchRebalance(ctx context.Context, out io.Writer, b rebalanceBench) error {
	if b.log == nil {
		b.log = zap.NewNop()
	}
	p := b.policy
	header(out, "rebalance", b.opsBench, fmt.Sprintf("; short requests %d tokens, arrivals over %v; policy: every %v, waiting > %d, KV ≥ %.2f, spread > %.2f, %d per decision, cooldown %v",
		b.shortTokens, b.stagger, p.Interval, p.WaitingHigh, p.KVHigh, p.Spread, p.MaxRequests, p.Cooldown))
	reqs := b.load()
	var runs [2]rebalanceRun
	for k, on := range []bool{false, true} {
		r, err := b.runOnce(ctx, reqs, on)
		if err != nil {
			return err
		}
		runs[k] = r
		name := "off"
		if on {
			name = "on "
		}
		fmt.Fprintf(out, "policy %s short requests' TTFT p50 %s, p99 %s, max %s; long requests done p50 %.2f s, max %.2f s; %d decisions, %d requests moved\n",
			name, msText(loadgen.Percentile(r.shortTTFT, 0.5)), msText(loadgen.Percentile(r.shortTTFT, 0.99)), msText(loadgen.Percentile(r.shortTTFT, 1)),
			loadgen.Percentile(r.longDone, 0.5).Seconds(), loadgen.Percentile(r.longDone, 1).Seconds(), r.decisions, r.moves)
	}
	off, on := runs[0], runs[1]
	if c := checkStreams(off.streams, off.streams); c.Failed > 0 || c.Inexact > 0 {
		return c.err("the run with the policy off")
	}
	check := checkStreams(on.streams, off.streams)
	fmt.Fprintf(out, "short requests' p99 TTFT off ÷ on: %.2f×; with the policy on, every stream against the same stream with it off: %s\n",
		float64(loadgen.Percentile(off.shortTTFT, 0.99))/float64(max(loadgen.Percentile(on.shortTTFT, 0.99), 1)), check)
	if err := check.err("the run with the policy on"); err != nil {
		return err
	}
	if on.moves == 0 {
		return fmt.Errorf("the balancer moved nothing, so the run compares nothing: the load was not skewed enough (more --streams or --max-tokens)")
	}
	return nil
}

func (b rebalanceBench) runOnce(ctx context.Context, reqs []loadgen.Request, on bool) (rebalanceRun, error) {
	var r rebalanceRun
	st, err := b.start(func(c *host.Config) {
		if on {
			c.Rebalance = b.policy
		}
	})
	if err != nil {
		return r, err
	}
	defer st.Stop()
	r.streams = loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "demo-model", Stagger: b.stagger}, reqs)
	for i, s := range r.streams {
		if len(s.Arrivals) == 0 {
			continue
		}
		if longAt(i) {
			r.longDone = append(r.longDone, s.Arrivals[len(s.Arrivals)-1].Sub(s.Start))
		} else {
			r.shortTTFT = append(r.shortTTFT, s.Arrivals[0].Sub(s.Start))
		}
	}
	rs, err := st.Client().Rebalance(ctx)
	if err != nil {
		return r, err
	}
	for _, d := range rs.Decisions {
		r.decisions++
		if d.Migration == "" {
			continue
		}
		m, err := st.Client().WaitMigration(ctx, d.Migration, 10*time.Millisecond, nil)
		if err != nil {
			return r, err
		}
		r.moves += m.Migrated
	}
	return r, nil
}

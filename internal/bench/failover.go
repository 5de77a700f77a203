package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/failover"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

func newBenchFailoverCommand(g *Options) *cobra.Command {
	var o opsBench
	var interval time.Duration
	var modes []string
	var x failoverHostFlags
	cmd := &cobra.Command{
		Use:   "failover",
		Short: "Engine-crash failover: the clients' gap when a loaded engine dies, by snapshot and by replay, against none",
		Long: `Starts a Host with two active sims of one model in this process and streams --streams
streams through it (spread over them; --engines 3 adds a third active sim). After --delay, engine A stops at once, its
connections cut as a killed process's are. Each --mode runs on a fresh deployment:
  snapshot  failover on (the Host's default): A's streams are reinstalled on B (recompute
            of prompt + output) with exactly the tokens each client has, as the relay read
            them (the engines' token ids), the sampling state from a snapshot taken every
            --snapshot-interval
  alone     the snapshot mode with each of A's streams placed alone (--failover-gather-window 0):
            on the survivor with the most free KV at its last heartbeat, rather than
            gathered and spread over the survivors
  paced     the snapshot mode with each survivor fed its share in installs of at most
            --paced-tokens tokens of context, each once the last one's prefill is done
            (--failover-recompute-per-step)
  warm      the snapshot mode with warm standbys (--failover-warm-standby-tokens --warm-tokens):
            each of A's streams whose context reached --warm-tokens has its KV copied to
            the survivor each --warm-interval, and its failover installs that copy and
            computes only the tokens since the last round
  snapshot-only  the same with the relay's token ids off (--failover-token-ids=false):
            from the latest snapshot alone, cut to what the client has, the tokens since
            regenerated
  replay    failover on, no snapshot taken yet (the first is an hour away): A's streams are
            sent again to B, the tokens the client has skipped
  off       failover off: what a client gets without it
For A's streams that went on it reports the gap across the crash (each one's longest
inter-token gap from the crash on) and crash → that gap's end (p50, p99, max), their
inter-token gaps' p99 and median in the 2 s before the crash (what warm copies cost the
source's decode), the
survivors' own streams' longest gap in the 3 s after the crash (p50, p99) against the run's
median gap, and every stream is checked against an
unmigrated run. Then, on B alone, one prefill of the longest context A carried (its prompt
and the text it had sent) is timed: the goal is a p99 gap within detection (here the cut
connection, at once) plus that prefill.

With --host it starts nothing and runs against a deployment: a running Host with at least
two active migratable instances of the model, its failover as the Host was started (--mode
does not apply). The load (greedy) runs through it once as the reference, then again with
the active instance running the most streams killed after --delay by --kill, a shell command
run with VHI_VICTIM_ID and VHI_VICTIM_URL set (e.g. 'kill -KILL -$(cat /run/$VHI_VICTIM_ID.pgid)':
a negative pid, the engine's whole process group); the streams on it are read from its
engine (--agent-token-file) just before. Exact only on engines whose output is the same in
every batch (real vLLM: a random-weight checkpoint and VLLM_BATCH_INVARIANT=1).`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			o.log = log
			if x.host != "" {
				if x.kill == "" {
					return fmt.Errorf("--host needs --kill: the command that kills the victim's engine")
				}
				return runBenchFailoverHost(cmd.Context(), cmd.OutOrStdout(), o, x)
			}
			for _, m := range modes {
				if m != "snapshot" && m != "alone" && m != "paced" && m != "warm" && m != "snapshot-only" && m != "replay" && m != "off" {
					return fmt.Errorf("--mode %q: want snapshot, alone, paced, warm, snapshot-only, replay or off", m)
				}
			}
			if o.actives != 2 && o.actives != 3 {
				return fmt.Errorf("--engines %d: want 2 or 3", o.actives)
			}
			if interval <= 0 {
				return fmt.Errorf("--snapshot-interval %v must be positive", interval)
			}
			return runBenchFailover(cmd.Context(), cmd.OutOrStdout(), o, interval, modes)
		}),
	}
	o.register(cmd.Flags(), 128, 400, 3*time.Second)
	cmd.Flags().DurationVar(&interval, "snapshot-interval", time.Second, "the Host's --failover-snapshot-interval in the snapshot mode")
	cmd.Flags().StringSliceVar(&modes, "mode", []string{"snapshot", "snapshot-only", "replay", "off"}, "failover modes to compare (snapshot, alone, paced, warm, snapshot-only, replay, off)")
	cmd.Flags().DurationVar(&o.warmInterval, "warm-interval", failover.DefaultConfig().WarmInterval, "the warm mode's --failover-warm-standby-interval")
	cmd.Flags().IntVar(&o.warmTokens, "warm-tokens", 1, "the warm mode's --failover-warm-standby-tokens: streams with at least this much context get warm copies")
	cmd.Flags().IntVar(&o.pacedTokens, "paced-tokens", 2048, "the paced mode's --failover-recompute-per-step")
	cmd.Flags().IntVar(&o.actives, "engines", 2, "active sims (2 or 3); A is the one killed")
	cmd.Flags().StringVar(&x.host, "host", "", "run against this running Host (its URL) instead of starting sims")
	cmd.Flags().StringVar(&x.model, "model", "", "with --host: the served model to load (default: the first active instance's)")
	cmd.Flags().StringVar(&x.adminTokenFile, "admin-token-file", "", "with --host: file holding the admin token (default: the local Host's)")
	cmd.Flags().StringVar(&x.agentTokenFile, "agent-token-file", "", "with --host: file holding the agent token, to list the victim engine's requests (default: the local Host's)")
	cmd.Flags().StringVar(&x.kill, "kill", "", "with --host: shell command that kills the victim's engine (VHI_VICTIM_ID, VHI_VICTIM_URL set)")
	return cmd
}

// crashResult is one mode's run.
type crashResult struct {
	affected      int // streams on A when it died
	gaps, resumes []time.Duration
	// The survivors' own streams: each one's longest gap in the 3 s after
	// the crash, and the median inter-token gap of the whole run.
	survivorGaps []time.Duration
	medianGap    time.Duration
	check        streamCheck
	// The stream of A's with the most context at the crash: its prompt,
	// the text it had sent by then, and the two's words.
	longestPrompt, longestSent string
	longestContext             int
	contextTokens              int // prompt + sent words of every stream A carried
	// A's streams' inter-token gaps in the 2 s before the crash.
	gapsBefore []time.Duration
	// The warm mode: copies held when A died, bytes copied by then, and
	// streams the Host recovered from a copy.
	warmCopies, warmRecovered int
	warmBytes                 int64
}

func runBenchFailover(ctx context.Context, out io.Writer, o opsBench, interval time.Duration, modes []string) error {
	if o.log == nil {
		o.log = zap.NewNop()
	}
	o.actives = max(o.actives, 2)
	header(out, "failover", o, fmt.Sprintf("; %d active engines, A killed after %v", o.actives, o.delay))
	reqs := o.requests()
	ref, err := o.reference(ctx, reqs)
	if err != nil {
		return err
	}
	var failed []string
	var prefillCtx crashResult
	for _, mode := range modes {
		iv := interval
		switch mode {
		case "replay":
			iv = time.Hour
		case "off":
			iv = 0
		}
		fc := failover.DefaultConfig()
		fc.SnapshotInterval, fc.RelayTokenIDs = iv, mode != "snapshot-only"
		if mode == "replay" {
			fc.NewStreamSnapshot = 0 // no snapshot at all: the replay path
		}
		switch mode {
		case "alone":
			fc.GatherWindow = 0
		case "paced":
			fc.RecomputePerStep = o.pacedTokens
		case "warm":
			if o.warmTokens < 1 {
				return fmt.Errorf("--warm-tokens %d must be at least 1", o.warmTokens)
			}
			fc.WarmTokens, fc.WarmInterval = o.warmTokens, o.warmInterval
		}
		r, err := o.crashOnce(ctx, reqs, ref, fc)
		if err != nil {
			return fmt.Errorf("mode %s: %w", mode, err)
		}
		fmt.Fprintf(out, "%-13s %s\n", mode, r.report(mode == "warm"))
		if mode != "off" && (r.check.Failed > 0 || r.check.Inexact > 0) {
			failed = append(failed, mode)
		}
		if mode == "off" && r.check.Failed == 0 && r.affected > 0 {
			failed = append(failed, "off (no stream failed without failover: the crash did not cut them)")
		}
		if r.longestContext > prefillCtx.longestContext {
			prefillCtx = r
		}
	}
	if prefillCtx.affected > 0 {
		ttft, toks, err := o.timePrefill(ctx, prefillCtx.longestPrompt+prefillCtx.longestSent)
		if err != nil {
			return err
		}
		c := o.simConfig()
		fmt.Fprintf(out, "one prefill of the longest context A carried (%d tokens), on an idle engine: %s; all of A's contexts together: %d tokens, %d prefill steps of %d\n",
			toks, msText(ttft), prefillCtx.contextTokens, (prefillCtx.contextTokens+c.MaxNumBatchedTokens-1)/c.MaxNumBatchedTokens, c.MaxNumBatchedTokens)
	}
	if len(failed) > 0 {
		return fmt.Errorf("failover runs with failed or inexact streams: %s", strings.Join(failed, ", "))
	}
	return nil
}

// crashOnce runs the load on a fresh deployment with failover fc and
// kills engine A after the delay.
func (o opsBench) crashOnce(ctx context.Context, reqs []loadgen.Request, ref []loadgen.Stream, fc failover.Config) (crashResult, error) {
	var r crashResult
	st, err := o.start(func(c *host.Config) { c.Failover = fc })
	if err != nil {
		return r, err
	}
	defer st.Stop()
	done, t0 := loadThrough(ctx, st, reqs)
	if err := wait(ctx, time.Until(t0.Add(o.delay))); err != nil {
		return r, err
	}
	onA, err := st.A.Requests(ctx)
	if err != nil {
		return r, err
	}
	killed := time.Now()
	r.warmCopies, r.warmBytes = st.Host.Failover().WarmCopies(), st.Host.Failover().WarmBytes()
	warmBefore := st.Host.Failover().WarmRecovered()
	st.KillEngine(st.AID)
	streams := <-done
	r.warmRecovered = st.Host.Failover().WarmRecovered() - warmBefore
	ids := map[string]bool{}
	for _, q := range onA.Requests {
		ids[q.RequestID] = true
	}
	m := crashMetrics(streams, reqs, ref, ids, killed, t0)
	m.warmCopies, m.warmBytes, m.warmRecovered = r.warmCopies, r.warmBytes, r.warmRecovered
	return m, nil
}

// crashMetrics measures a crash run: streams (of reqs, with references
// ref) whose ids were on the killed engine (ids), killed at killed, the
// load begun at t0.
func crashMetrics(streams []loadgen.Stream, reqs []loadgen.Request, ref []loadgen.Stream, ids map[string]bool, killed, t0 time.Time) crashResult {
	var r crashResult
	r.check = checkStreams(streams, ref)
	var all []time.Duration
	for _, s := range streams {
		for j := 1; j < len(s.Arrivals); j++ {
			all = append(all, s.Arrivals[j].Sub(s.Arrivals[j-1]))
		}
	}
	r.medianGap = loadgen.Percentile(all, 0.5)
	for i, s := range streams {
		if !ids[s.ID] {
			if g := worstGapIn(s.Arrivals, killed, killed.Add(3*time.Second)); g > 0 {
				r.survivorGaps = append(r.survivorGaps, g)
			}
			continue
		}
		r.affected++
		for j := 1; j < len(s.Arrivals); j++ {
			if at := s.Arrivals[j]; at.After(killed.Add(-2*time.Second)) && !at.After(killed) && s.Arrivals[j-1].After(t0) {
				r.gapsBefore = append(r.gapsBefore, at.Sub(s.Arrivals[j-1]))
			}
		}
		sent := 0
		for sent < len(s.Arrivals) && !s.Arrivals[sent].After(killed) {
			sent++
		}
		// Tokens A had written before it died may still arrive just after
		// the kill: the stream's gap is its longest one from the kill on,
		// the one it waited for B.
		if s.Err == nil && sent > 0 && sent < len(s.Arrivals) {
			gap, at := time.Duration(0), sent
			for j := sent; j < len(s.Arrivals); j++ {
				if g := s.Arrivals[j].Sub(s.Arrivals[j-1]); g > gap {
					gap, at = g, j
				}
			}
			r.gaps = append(r.gaps, gap)
			r.resumes = append(r.resumes, s.Arrivals[at].Sub(killed))
		}
		// What A had sent by the crash is the reference's first tokens
		// (a failed stream's too).
		n := len(strings.Fields(reqs[i].Prompt)) + sent
		r.contextTokens += n
		if n > r.longestContext {
			r.longestContext, r.longestPrompt = n, reqs[i].Prompt
			r.longestSent = strings.Join(ref[i].Pieces[:min(sent, len(ref[i].Pieces))], "")
		}
	}
	return r
}

// report says what the run measured (warm: with the warm copies).
func (r crashResult) report(warm bool) string {
	gaps := "none of them went on"
	if len(r.gaps) > 0 {
		gaps = fmt.Sprintf("%d went on: gap across the crash p50 %s, p99 %s, max %s; crash → its end p50 %s, p99 %s, max %s",
			len(r.gaps), msText(loadgen.Percentile(r.gaps, 0.5)), msText(loadgen.Percentile(r.gaps, 0.99)), msText(loadgen.Percentile(r.gaps, 1)),
			msText(loadgen.Percentile(r.resumes, 0.5)), msText(loadgen.Percentile(r.resumes, 0.99)), msText(loadgen.Percentile(r.resumes, 1)))
	}
	before := fmt.Sprintf("; A's streams before the crash: gap p99 %s, median %s", msText(loadgen.Percentile(r.gapsBefore, 0.99)), msText(loadgen.Percentile(r.gapsBefore, 0.5)))
	if warm {
		before += fmt.Sprintf("; warm copies at the crash %d, %.1f MiB copied, %d streams recovered from them", r.warmCopies, float64(r.warmBytes)/(1<<20), r.warmRecovered)
	}
	own := ""
	if len(r.survivorGaps) > 0 {
		own = fmt.Sprintf("; the survivors' own %d streams' worst gap in the 3 s after the crash p50 %s, p99 %s (the run's median gap %s)",
			len(r.survivorGaps), msText(loadgen.Percentile(r.survivorGaps, 0.5)), msText(loadgen.Percentile(r.survivorGaps, 0.99)), msText(r.medianGap))
	}
	return fmt.Sprintf("A carried %d streams, %s%s; every stream: %s%s", r.affected, gaps, before, r.check, own)
}

// worstGapIn is the longest gap between arrivals that ends in [from, to].
func worstGapIn(arrivals []time.Time, from, to time.Time) time.Duration {
	var worst time.Duration
	for j := 1; j < len(arrivals); j++ {
		if at := arrivals[j]; !at.Before(from) && !at.After(to) {
			worst = max(worst, at.Sub(arrivals[j-1]))
		}
	}
	return worst
}

// timePrefill times, on a fresh idle sim, the first token of one request
// with this prompt (a stream's prompt and the text it had sent): what
// reinstalling that stream costs its engine at least.
func (o opsBench) timePrefill(ctx context.Context, prompt string) (time.Duration, int, error) {
	c := o.simConfig()
	c.Model, c.ServedModelNames, c.ShmPrefix = "demo-model", nil, fmt.Sprintf("vhi-prefill-%d", os.Getpid())
	e, err := sim.Start(c, o.log)
	if err != nil {
		return 0, 0, err
	}
	defer e.Stop()
	got := loadgen.Run(ctx, loadgen.Config{BaseURL: e.URL, Model: "demo-model"}, []loadgen.Request{{Prompt: prompt, MaxTokens: 1, IgnoreEOS: true}})[0]
	if got.Err != nil || len(got.Arrivals) == 0 || got.Usage == nil {
		return 0, 0, fmt.Errorf("the prefill probe: %v", got.Err)
	}
	return got.Arrivals[0].Sub(got.Start), got.Usage.PromptTokens, nil
}

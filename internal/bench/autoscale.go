package bench

import (
	"context"
	"fmt"
	"image/color"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/autoscale"
	"github.com/vllm-hi/vllm-hi/internal/durations"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// autoscaleBench is vhi bench autoscale: the Elastic EP seed's scenario —
// load rising under an SLO on rolling p95 TTFT, the same requests
// replayed against three deployments: one that stays at its size, one
// restarted at the larger size, one scaled by elastic EP from the Host's
// autoscaler.
type autoscaleBench struct {
	duration                 time.Duration
	rateFrom, rateTo, hold   float64
	from, to                 int
	slo, window, penalty     time.Duration
	restartTime              time.Duration
	prepare, graph, activate time.Duration
	tokens, maxNumSeqs       int
	step                     time.Duration
	scaleOutAt, queueHigh    float64
	runningHigh              float64
	seed                     uint64
	deployments              []string
	plotPath                 string
	log                      *zap.Logger
}

// The deployments of the scenario.
const (
	deployStatic  = "static"
	deployRestart = "restart"
	deployElastic = "elastic"
)

func newBenchAutoscaleCommand(g *Options) *cobra.Command {
	b := autoscaleBench{}
	cmd := &cobra.Command{
		Use:   "autoscale",
		Short: "The Elastic EP seed's SLO scenario on a sim: rising load, static vs restart-to-larger vs elastic EP driven by the Host's autoscaler",
		Long: `Replays one request schedule — Poisson arrivals whose rate rises from --rate-from to --rate-to
over --duration and stays at the peak for its last --hold part, each a --tokens-token stream — against three deployments of a vhi sim with
elastic EP at --from data-parallel ranks (each rank --max-num-seqs seats, a --step decode step):
static (stays at --from), restart (stopped and started again at --to when the autoscaler of the
elastic run decided to scale, its in-flight requests failing and new ones refused for
--restart-time), and elastic (through a Host whose autoscaler holds the rolling p95 TTFT to --slo
over --window and scales the engine to --to by elastic EP: async prepare with graph reuse).
Defaults are the seed's scenario with every time divided by 10: a 5 s SLO → 0.5 s, 30 s window →
3 s, failed requests counted as 30 s → 3 s, the 16→20 GPU reconfiguration (92 s total, 0.82 s
commit) and a restart costing the blocking one (99.6 s). Reports per deployment the requests
completed and failed, the largest rolling p95 TTFT and the time it spent over the SLO; --plot
writes the rolling p95 over time for the three, as the seed's figure 3.`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			b.log = log
			for _, d := range b.deployments {
				if d != deployStatic && d != deployRestart && d != deployElastic {
					return fmt.Errorf("--deployments: %q is not static, restart or elastic", d)
				}
			}
			if b.hold < 0 || b.hold >= 1 || b.duration <= 0 || b.rateFrom <= 0 || b.rateTo <= 0 || b.from < 1 || b.to <= b.from || b.slo <= 0 || b.window <= 0 || b.tokens < 1 || b.maxNumSeqs < 1 {
				return fmt.Errorf("want --duration, --rate-from, --rate-to, --slo, --window > 0, 1 ≤ --from < --to, --tokens and --max-num-seqs ≥ 1")
			}
			return runBenchAutoscale(cmd.Context(), cmd.OutOrStdout(), b)
		}),
	}
	f := cmd.Flags()
	f.DurationVar(&b.duration, "duration", 150*time.Second, "how long the scenario runs")
	f.Float64Var(&b.rateFrom, "rate-from", 6.5, "requests per second at the start")
	f.Float64Var(&b.rateTo, "rate-to", 13, "requests per second at the peak")
	f.Float64Var(&b.hold, "hold", 0.3, "the last fraction of --duration the load stays at its peak")
	f.IntVar(&b.from, "from", 4, "data-parallel ranks at the start")
	f.IntVar(&b.to, "to", 5, "data-parallel ranks to scale (or restart) to")
	f.DurationVar(&b.slo, "slo", 500*time.Millisecond, "the rolling p95 TTFT to hold")
	f.DurationVar(&b.window, "window", 3*time.Second, "the rolling window")
	f.DurationVar(&b.penalty, "penalty", 3*time.Second, "the TTFT a failed request counts as")
	f.DurationVar(&b.restartTime, "restart-time", 9962*time.Millisecond, "how long the restarted deployment is down")
	f.DurationVar(&b.prepare, "prepare-time", 3930*time.Millisecond, "elastic: starting joining workers, communication, weights (in the background)")
	f.DurationVar(&b.graph, "graph-time", 5720*time.Millisecond, "elastic: warm-up and graphs of the joining ranks (in the background: graph reuse)")
	f.DurationVar(&b.activate, "activate-time", 82*time.Millisecond, "elastic: activating the topology (the commit)")
	f.IntVar(&b.tokens, "tokens", 256, "tokens per request")
	f.IntVar(&b.maxNumSeqs, "max-num-seqs", 32, "seats per rank")
	f.DurationVar(&b.step, "step", 40*time.Millisecond, "the sim's decode step")
	f.Float64Var(&b.scaleOutAt, "scale-out-at", 0.2, "the autoscaler scales out above this fraction of the SLO")
	f.Float64Var(&b.queueHigh, "queue-high", 1, "… or with more requests waiting per rank")
	f.Float64Var(&b.runningHigh, "running-high", 0.8, "… or with more requests running per rank than this fraction of its seats (0: off)")
	f.Uint64Var(&b.seed, "seed", 1, "the arrival schedule's seed")
	f.StringSliceVar(&b.deployments, "deployments", []string{deployElastic, deployStatic, deployRestart}, "deployments to run (elastic first: its decision times the restart)")
	f.StringVar(&b.plotPath, "plot", "", "write a PNG of the rolling p95 TTFT over time here")
	return cmd
}

// shot is one request of the schedule as a deployment answered it.
type shot struct {
	at     time.Duration // its arrival, from the start
	ttft   time.Duration
	failed bool
}

// sloRun is one deployment's figures.
type sloRun struct {
	name             string
	shots            []shot
	completed, fails int
	maxP95, overSLO  time.Duration
	curve            plotter.XYs
	note             string
}

// schedule is the arrival times: a Poisson process whose rate rises
// linearly, then holds (inverting its cumulative rate), the same for
// every deployment.
func (b autoscaleBench) schedule() []time.Duration {
	r := rand.New(rand.NewPCG(b.seed, 0x5ca1e))
	T := b.duration.Seconds()
	rise := T * (1 - b.hold)
	slope := (b.rateTo - b.rateFrom) / rise
	atRise := b.rateFrom*rise + slope*rise*rise/2 // Λ at the end of the rise
	var out []time.Duration
	cum := 0.0 // the cumulative rate Λ(t) reached
	for {
		cum += r.ExpFloat64()
		var t float64
		switch {
		case cum >= atRise:
			t = rise + (cum-atRise)/b.rateTo
		case slope == 0:
			t = cum / b.rateFrom
		default: // from·t + slope·t²/2 = cum
			t = (-b.rateFrom + math.Sqrt(b.rateFrom*b.rateFrom+2*slope*cum)) / slope
		}
		if t >= T {
			return out
		}
		out = append(out, time.Duration(t*float64(time.Second)))
	}
}

func (b autoscaleBench) simConfig(dp int) sim.Config {
	c := sim.DefaultConfig()
	c.Model, c.ServedModelNames = "moe", []string{"moe"}
	c.Profile, c.KVScale, c.NumBlocks, c.MaxModelLen = "tiny", 1, 16384, 1024
	c.MaxNumSeqs, c.MaxNumBatchedTokens = b.maxNumSeqs, 2048
	c.Step = sim.StepModel{Fixed: b.step}
	c.DataParallelSize, c.ElasticEP, c.ElasticMode = dp, true, sim.ElasticAsyncGraphReuse
	c.ElasticPrepareTime, c.ElasticGraphTime, c.ElasticActivateTime = b.prepare, b.graph, b.activate
	return c
}

func runBenchAutoscale(ctx context.Context, out io.Writer, b autoscaleBench) error {
	if b.log == nil {
		b.log = zap.NewNop()
	}
	arrivals := b.schedule()
	fmt.Fprintf(out, "vhi bench autoscale: %d requests over %v, %.1f → %.1f req/s (the last %.0f %% at the peak), %d tokens each; sim DP %d → %d, %d seats per rank, %v steps; SLO: rolling p95 TTFT (%v window) < %v, failed requests count as %v\n",
		len(arrivals), b.duration, b.rateFrom, b.rateTo, 100*b.hold, b.tokens, b.from, b.to, b.maxNumSeqs, b.step, b.window, b.slo, b.penalty)
	restartAt := b.duration / 2
	var runs []sloRun
	for _, d := range b.deployments {
		var r sloRun
		var err error
		switch d {
		case deployStatic:
			r, err = b.runDirect(ctx, arrivals, 0)
			r.note = fmt.Sprintf("DP %d throughout", b.from)
		case deployRestart:
			r, err = b.runDirect(ctx, arrivals, restartAt)
			r.note = fmt.Sprintf("restarted at DP %d at %.1f s, down %v", b.to, restartAt.Seconds(), b.restartTime)
		case deployElastic:
			var decided time.Duration
			r, decided, err = b.runElastic(ctx, arrivals)
			if decided > 0 {
				restartAt = decided
			}
		}
		if err != nil {
			return fmt.Errorf("%s: %w", d, err)
		}
		r.name = d
		b.summarize(&r)
		runs = append(runs, r)
		fmt.Fprintf(out, "%-8s %d completed, %d failed; rolling p95 TTFT max %.3f s, over the SLO for %.1f s of %.0f s; %s\n",
			d, r.completed, r.fails, r.maxP95.Seconds(), r.overSLO.Seconds(), b.duration.Seconds(), r.note)
	}
	if b.plotPath != "" {
		if err := b.plot(runs); err != nil {
			return err
		}
		fmt.Fprintf(out, "plot: %s\n", b.plotPath)
	}
	for _, r := range runs {
		if r.name == deployElastic && (r.fails > 0 || r.overSLO > 0) {
			return fmt.Errorf("elastic: %d requests failed, %.1f s over the SLO", r.fails, r.overSLO.Seconds())
		}
	}
	return nil
}

// fire sends the schedule to the URL base() names at each request's time
// and returns the answers once all have ended.
func (b autoscaleBench) fire(ctx context.Context, arrivals []time.Duration, base func() string) []shot {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024}}
	shots := make([]shot, len(arrivals))
	t0 := time.Now()
	var wg sync.WaitGroup
	for i, at := range arrivals {
		if d := time.Until(t0.Add(at)); d > 0 {
			select {
			case <-ctx.Done():
				return shots[:i]
			case <-time.After(d):
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			rctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
			defer cancel()
			s := loadgen.Run(rctx, loadgen.Config{BaseURL: base(), Model: "moe", Client: client},
				[]loadgen.Request{{Prompt: "rising load", MaxTokens: b.tokens, IgnoreEOS: true}})[0]
			sh := shot{at: at, failed: s.Err != nil || s.Done != 1 || len(s.Arrivals) == 0}
			if !sh.failed {
				sh.ttft = s.Arrivals[0].Sub(s.Start)
			}
			shots[i] = sh
		}()
	}
	wg.Wait()
	return shots
}

// runDirect is the static deployment (restartAt 0) or the one restarted
// at the larger size then: clients talk to the engine, as without vllm-hi.
func (b autoscaleBench) runDirect(ctx context.Context, arrivals []time.Duration, restartAt time.Duration) (sloRun, error) {
	eng, err := sim.Start(b.simConfig(b.from), b.log.Named("sim"))
	if err != nil {
		return sloRun{}, err
	}
	var cur atomic.Pointer[sim.Running]
	cur.Store(eng)
	var url atomic.Value
	url.Store(eng.URL)
	done := make(chan struct{})
	var restartErr error
	if restartAt > 0 {
		go func() {
			defer close(done)
			select {
			case <-ctx.Done():
				return
			case <-time.After(restartAt):
			}
			// Down: its streams cut, nothing listening until it is back.
			cur.Load().Stop()
			url.Store("http://127.0.0.1:1")
			time.Sleep(b.restartTime)
			next, err := sim.Start(b.simConfig(b.to), b.log.Named("sim"))
			if err != nil {
				restartErr = err
				return
			}
			cur.Store(next)
			url.Store(next.URL)
		}()
	} else {
		close(done)
	}
	shots := b.fire(ctx, arrivals, func() string { return url.Load().(string) })
	<-done
	cur.Load().Stop()
	return sloRun{shots: shots}, restartErr
}

// runElastic is the deployment scaled through the Host: its autoscaler
// holds the SLO by elastic EP. It returns when the autoscaler decided.
func (b autoscaleBench) runElastic(ctx context.Context, arrivals []time.Duration) (sloRun, time.Duration, error) {
	std := b.simConfig(1)
	std.ElasticEP = false
	st, err := stack.Start(stack.Options{Model: "moe", SimA: b.simConfig(b.from), SimB: std, Log: b.log, TuneHost: func(hc *host.Config) {
		hc.Autoscale = autoscale.Config{IntervalS: 0.1, FailurePenaltyS: durations.Of(b.penalty), Models: map[string]autoscale.Policy{
			"moe": {Kind: autoscale.KindDataParallel, Min: b.from, Max: b.to, Start: b.from, SLOS: durations.Of(b.slo), WindowS: durations.Of(b.window),
				ScaleOutAt: b.scaleOutAt, ScaleInAt: b.scaleOutAt / 4, QueueHigh: b.queueHigh, MinSamples: 10,
				RunningHigh: b.runningHigh * float64(b.maxNumSeqs),
				CooldownS:   durations.Of(2 * b.duration)}, // no scale-in while the load rises
		}}
	}})
	if err != nil {
		return sloRun{}, 0, err
	}
	defer st.Stop()
	t0 := time.Now()
	shots := b.fire(ctx, arrivals, func() string { return st.HostURL })
	r := sloRun{shots: shots, note: "the autoscaler did not scale"}
	status, err := st.Client().Autoscale(ctx)
	if err != nil {
		return r, 0, err
	}
	var decided time.Duration
	for _, d := range status.Decisions {
		if d.ScaleID == "" {
			continue
		}
		decided = d.At.Sub(t0)
		sc, _ := st.Client().ScaleStatus(ctx, d.ScaleID)
		r.note = fmt.Sprintf("the autoscaler decided at %.1f s (%s: %s): DP %d → %d %s, prepare %.2f s, commit (downtime) %.3f s, %d requests held",
			decided.Seconds(), d.Reason, d.Detail, d.From, d.To, sc.State, phaseS(sc, "prepare"), sc.DowntimeS, sc.HeldRequests)
	}
	return r, decided, nil
}

func phaseS(st hostapi.ScaleStatus, name string) float64 {
	for _, p := range st.Phases {
		if p.Phase == name {
			return p.DurationS
		}
	}
	return 0
}

// summarize counts r's requests and draws its rolling p95 curve: every
// 0.25 s, the p95 TTFT of the requests that arrived within the window
// before (failed ones counted as the penalty).
func (b autoscaleBench) summarize(r *sloRun) {
	sort.Slice(r.shots, func(i, j int) bool { return r.shots[i].at < r.shots[j].at })
	for _, s := range r.shots {
		if s.failed {
			r.fails++
		} else {
			r.completed++
		}
	}
	const every = 250 * time.Millisecond
	lo := 0
	for t := b.window; t <= b.duration; t += every {
		for lo < len(r.shots) && r.shots[lo].at < t-b.window {
			lo++
		}
		var vals []time.Duration
		for _, s := range r.shots[lo:] {
			if s.at >= t {
				break
			}
			v := s.ttft
			if s.failed {
				v = b.penalty
			}
			vals = append(vals, v)
		}
		if len(vals) == 0 {
			continue
		}
		p := loadgen.Percentile(vals, 0.95)
		r.maxP95 = max(r.maxP95, p)
		if p > b.slo {
			r.overSLO += every
		}
		r.curve = append(r.curve, plotter.XY{X: t.Seconds(), Y: p.Seconds()})
	}
}

// plot draws the rolling p95 TTFT of each deployment against the SLO.
func (b autoscaleBench) plot(runs []sloRun) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("Rising load (%.1f → %.1f req/s, then held): rolling p95 TTFT (%v window; failed = %v) — sim, times ÷10", b.rateFrom, b.rateTo, b.window, b.penalty)
	p.X.Label.Text = "time (s)"
	p.Y.Label.Text = "rolling p95 TTFT (s)"
	colors := map[string]color.Color{deployStatic: color.RGBA{R: 120, G: 120, B: 120, A: 255}, deployRestart: color.RGBA{R: 220, G: 80, B: 60, A: 255},
		deployElastic: color.RGBA{R: 40, G: 110, B: 200, A: 255}}
	labels := map[string]string{deployStatic: fmt.Sprintf("static DP %d", b.from), deployRestart: fmt.Sprintf("restart to DP %d", b.to),
		deployElastic: fmt.Sprintf("elastic EP %d → %d (Host autoscaler)", b.from, b.to)}
	p.Add(plotter.NewGrid())
	top := b.slo.Seconds()
	for _, r := range runs {
		l, err := plotter.NewLine(r.curve)
		if err != nil {
			return err
		}
		l.Color, l.Width = colors[r.name], vg.Points(1.5)
		p.Add(l)
		p.Legend.Add(labels[r.name], l)
		top = max(top, r.maxP95.Seconds())
	}
	slo, err := plotter.NewLine(plotter.XYs{{X: 0, Y: b.slo.Seconds()}, {X: b.duration.Seconds(), Y: b.slo.Seconds()}})
	if err != nil {
		return err
	}
	slo.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
	slo.Color = color.Black
	p.Add(slo)
	p.Legend.Add(fmt.Sprintf("SLO %v", b.slo), slo)
	p.Legend.Top, p.Legend.Left = true, true
	p.Legend.Padding = vg.Points(2)
	p.X.Min, p.X.Max = 0, b.duration.Seconds()
	p.Y.Min, p.Y.Max = 0, 1.4*top
	return p.Save(9*vg.Inch, 4.5*vg.Inch, b.plotPath)
}

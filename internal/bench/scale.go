package bench

import (
	"context"
	"fmt"
	"image/color"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// scaleBench is vhi bench scale: the seed's table of elastic-EP
// reconfiguration modes, on a sim, through the Host, with a client talking
// to the engine directly beside it as the baseline.
type scaleBench struct {
	modes                    []string
	from, to                 int
	prepare, graph, activate time.Duration
	interval, directInterval time.Duration
	tokens                   int
	plotPath                 string
	log                      *zap.Logger
	maxNumSeqs               int
}

func newBenchScaleCommand(g *Options) *cobra.Command {
	b := scaleBench{}
	cmd := &cobra.Command{
		Use:   "scale",
		Short: "Elastic EP's three reconfiguration modes (the seed's table) through the Host: downtime, total, client errors against a direct client",
		Long: `For each --modes (blocking, async, async_graph_reuse) starts a Host and a vhi sim with elastic EP
at --from ranks, streams requests through the Host (one every --interval) and, beside them, to
the engine directly (one every --direct-interval: the baseline of a client without the Host),
and scales the engine to --to ranks through the Host (POST /vllm_hi/scale). The costs default to
the seed's DeepSeek V4 Pro 16→20 GPU figures divided by 20 (workers, communication and weights
39.3 s, warm-up and graphs 57.2 s, activation 0.82 s). Reports per mode the engine's own prepare
and commit, the Host's downtime and total, what the Host added to the commit, the requests held,
and the errors each client saw; --plot writes a PNG of downtime and total per mode.`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			b.log = log
			for _, m := range b.modes {
				if m != sim.ElasticBlocking && m != sim.ElasticAsync && m != sim.ElasticAsyncGraphReuse {
					return fmt.Errorf("--modes: %q is not blocking, async or async_graph_reuse", m)
				}
			}
			if b.from < 1 || b.to < 1 || b.from == b.to || b.interval <= 0 || b.directInterval <= 0 {
				return fmt.Errorf("--from and --to: two different sizes ≥ 1; --interval and --direct-interval > 0")
			}
			return runBenchScale(cmd.Context(), cmd.OutOrStdout(), b)
		}),
	}
	f := cmd.Flags()
	f.StringSliceVar(&b.modes, "modes", []string{sim.ElasticBlocking, sim.ElasticAsync, sim.ElasticAsyncGraphReuse}, "reconfiguration modes to run")
	f.IntVar(&b.from, "from", 2, "data-parallel size before")
	f.IntVar(&b.to, "to", 4, "data-parallel size after")
	f.DurationVar(&b.prepare, "prepare-time", 1965*time.Millisecond, "starting joining workers, communication, weights")
	f.DurationVar(&b.graph, "graph-time", 2861*time.Millisecond, "warm-up and graph capture")
	f.DurationVar(&b.activate, "activate-time", 41*time.Millisecond, "activating the topology")
	f.DurationVar(&b.interval, "interval", 20*time.Millisecond, "between two requests through the Host")
	f.DurationVar(&b.directInterval, "direct-interval", 100*time.Millisecond, "between two requests straight to the engine")
	f.IntVar(&b.tokens, "tokens", 32, "tokens per request")
	f.IntVar(&b.maxNumSeqs, "max-num-seqs", 64, "seats per rank")
	f.StringVar(&b.plotPath, "plot", "", "write a PNG of downtime and total per mode here")
	return cmd
}

// scaleRun is one mode's figures.
type scaleRun struct {
	mode                   string
	status                 hostapi.ScaleStatus
	enginePrepare, commit  time.Duration
	viaHost, direct        int
	hostErrs, directErrs   int
	firstDirectErr         string
	maxStall               time.Duration
	hostTTFTp99DuringScale time.Duration
}

func runBenchScale(ctx context.Context, out io.Writer, b scaleBench) error {
	if b.log == nil {
		b.log = zap.NewNop()
	}
	fmt.Fprintf(out, "vhi bench scale: DP %d → %d, costs: workers+communication+weights %v, warm-up+graphs %v, activation %v; a %d-token request through the Host every %v, one straight to the engine every %v\n",
		b.from, b.to, b.prepare, b.graph, b.activate, b.tokens, b.interval, b.directInterval)
	var runs []scaleRun
	for _, mode := range b.modes {
		r, err := b.runMode(ctx, mode)
		if err != nil {
			return fmt.Errorf("%s: %w", mode, err)
		}
		runs = append(runs, r)
		st := r.status
		fmt.Fprintf(out, "%-18s engine: prepare %.3f s, commit %.3f s | Host: %s, downtime %.3f s (%+.1f ms against the engine's commit), total %.3f s, %d held | through the Host: %d requests, %d errors, longest stall %s, TTFT p99 %s | direct: %d requests, %d errors%s\n",
			mode, r.enginePrepare.Seconds(), r.commit.Seconds(), st.State, st.DowntimeS, 1000*(st.DowntimeS-r.commit.Seconds()), st.TotalS, st.HeldRequests,
			r.viaHost, r.hostErrs, msText(r.maxStall), msText(r.hostTTFTp99DuringScale), r.direct, r.directErrs, r.firstDirectErr)
	}
	if b.plotPath != "" {
		if err := plotScale(b.plotPath, runs); err != nil {
			return err
		}
		fmt.Fprintf(out, "plot: %s\n", b.plotPath)
	}
	for _, r := range runs {
		if r.status.State != hostapi.StateSucceeded || r.hostErrs > 0 {
			return fmt.Errorf("%s: scale %s, %d client errors through the Host", r.mode, r.status.State, r.hostErrs)
		}
	}
	return nil
}

func (b scaleBench) runMode(ctx context.Context, mode string) (scaleRun, error) {
	r := scaleRun{mode: mode}
	c := sim.DefaultConfig()
	c.NumBlocks, c.MaxNumSeqs, c.MaxNumBatchedTokens = 2048, b.maxNumSeqs, max(2048, b.maxNumSeqs)
	std := c
	c.DataParallelSize, c.ElasticEP, c.ElasticMode = b.from, true, mode
	c.ElasticPrepareTime, c.ElasticGraphTime, c.ElasticActivateTime = b.prepare, b.graph, b.activate
	st, err := stack.Start(stack.Options{Model: "moe", SimA: c, SimB: std, Log: b.log})
	if err != nil {
		return r, err
	}
	defer st.Stop()
	type sent struct {
		s  loadgen.Stream
		at time.Time
	}
	var mu sync.Mutex
	var viaHost, direct []sent
	stop := make(chan struct{})
	var wg sync.WaitGroup
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}
	send := func(base string, every time.Duration, into *[]sent) {
		defer wg.Done()
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				at := time.Now()
				s := loadgen.Run(ctx, loadgen.Config{BaseURL: base, Model: "moe", Client: client}, []loadgen.Request{{Prompt: "scale the experts", MaxTokens: b.tokens, IgnoreEOS: true}})[0]
				mu.Lock()
				*into = append(*into, sent{s, at})
				mu.Unlock()
			}()
		}
	}
	wg.Add(2)
	go send(st.HostURL, b.interval, &viaHost)
	go send(st.AURL, b.directInterval, &direct)
	time.Sleep(500 * time.Millisecond)
	id, err := st.Client().Scale(ctx, hostapi.ScaleRequest{ID: st.AID, DataParallelSize: &b.to})
	if err != nil {
		close(stop)
		wg.Wait()
		return r, err
	}
	if r.status, err = st.Client().WaitScale(ctx, id, 20*time.Millisecond, nil); err != nil {
		close(stop)
		wg.Wait()
		return r, err
	}
	time.Sleep(time.Second)
	close(stop)
	wg.Wait()
	r.enginePrepare, r.commit = st.A.LastScale()
	begin, end := r.status.CreatedAt, r.status.FinishedAt
	var ttfts []time.Duration
	for _, x := range viaHost {
		r.viaHost++
		if x.s.Err != nil || x.s.Done != 1 {
			r.hostErrs++
			continue
		}
		for j := 1; j < len(x.s.Arrivals); j++ {
			if a := x.s.Arrivals[j]; a.After(begin) && a.Before(end.Add(time.Second)) {
				r.maxStall = max(r.maxStall, a.Sub(x.s.Arrivals[j-1]))
			}
		}
		if x.at.After(begin) && x.at.Before(end) && len(x.s.Arrivals) > 0 {
			ttfts = append(ttfts, x.s.Arrivals[0].Sub(x.s.Start))
		}
	}
	r.hostTTFTp99DuringScale = loadgen.Percentile(ttfts, 0.99)
	for _, x := range direct {
		r.direct++
		if x.s.Err != nil {
			r.directErrs++
			if r.firstDirectErr == "" {
				r.firstDirectErr = " (" + strings.TrimSpace(x.s.Err.Error()) + ")"
			}
		}
	}
	return r, nil
}

// plotScale draws downtime and total time per mode, as the seed's table.
func plotScale(path string, runs []scaleRun) error {
	p := plot.New()
	p.Title.Text = "Elastic EP through the Host: downtime and total time per mode (sim)"
	p.Y.Label.Text = "seconds"
	var down, total plotter.Values
	var names []string
	for _, r := range runs {
		down = append(down, r.status.DowntimeS)
		total = append(total, r.status.TotalS)
		names = append(names, r.mode)
	}
	w := vg.Points(24)
	bd, err := plotter.NewBarChart(down, w)
	if err != nil {
		return err
	}
	bd.Color = color.RGBA{R: 220, G: 80, B: 60, A: 255}
	bd.Offset = -w / 2
	bt, err := plotter.NewBarChart(total, w)
	if err != nil {
		return err
	}
	bt.Color = color.RGBA{R: 60, G: 110, B: 200, A: 255}
	bt.Offset = w / 2
	p.Add(plotter.NewGrid(), bd, bt)
	p.Legend.Add("downtime (the Host's view of the commit)", bd)
	p.Legend.Add("total", bt)
	top := 0.0
	for _, v := range total {
		top = max(top, v)
	}
	p.Y.Min, p.Y.Max = 0, 1.35*top // room for the legend above the bars
	p.Legend.Top = true
	p.NominalX(names...)
	return p.Save(7*vg.Inch, 4*vg.Inch, path)
}

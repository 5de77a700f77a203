package bench

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// switchBench is vhi bench switch: an alternating trace over models that
// share one GPU, through the Host's switching and through llama-swap, on
// the same engines (vhi sim processes with modelled times).
type switchBench struct {
	models, phases                  int
	phase, interval                 time.Duration
	longEvery, longTokens, shortTok int
	levels                          []int
	sleep1, wake1                   time.Duration // level 1: /sleep, /wake_up
	sleep2, wake2, reload2          time.Duration // level 2: /sleep, each /wake_up call, reload_weights
	startup                         time.Duration // the engine's cold start (what llama-swap pays per swap)
	llamaSwap                       string
	log                             *zap.Logger
}

func newBenchSwitchCommand(g *Options) *cobra.Command {
	b := switchBench{}
	cmd := &cobra.Command{
		Use:   "switch",
		Short: "Model switching on an alternating trace: the Host's sleep/wake switching against llama-swap's restarts, same engines",
		Long: `Runs one trace several ways, one after the other: --models models share one GPU; the trace
has --phases phases of --phase each, phase k asking for model k mod --models, a request every
--interval, every --long-every-th one a long stream (--long-tokens), the rest --short-tokens;
long streams overlap the next phase. The engines are vhi sim processes whose sleep, wake-up,
weight reload and cold start take the times measured on real vLLM (the defaults:
docs/benchmarks.md, Qwen3-8B shape on one H200).

  vllm-hi, level L   the Host switches by sleep level L (--levels): drain, sleep, wake, probe
  llama-swap         with --llama-swap BIN: its default one-model-at-a-time swapping, which
                     stops an engine and starts the other (each start: --startup-time); the
                     first model is started before the trace, as the Host's engines are

Reports failed requests, TTFT p50/p99/max of every request and of the first request of each
phase (what a switch costs a client), and the Host's switch times.`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			b.log = log
			if b.models < 2 || b.phases < 2 || b.phase <= 0 || b.interval <= 0 || b.longEvery < 1 {
				return fmt.Errorf("--models ≥ 2, --phases ≥ 2, --phase and --interval > 0, --long-every ≥ 1")
			}
			for _, l := range b.levels {
				if l != 1 && l != 2 {
					return fmt.Errorf("--levels: 1 or 2, not %d", l)
				}
			}
			return runBenchSwitch(cmd.Context(), cmd.OutOrStdout(), b)
		}),
	}
	f := cmd.Flags()
	f.IntVar(&b.models, "models", 2, "models sharing the GPU")
	f.IntVar(&b.phases, "phases", 4, "phases of the trace")
	f.DurationVar(&b.phase, "phase", 20*time.Second, "how long each phase asks for one model")
	f.DurationVar(&b.interval, "interval", 500*time.Millisecond, "between two requests")
	f.IntVar(&b.longEvery, "long-every", 5, "every N-th request is a long stream")
	f.IntVar(&b.longTokens, "long-tokens", 600, "tokens of a long stream")
	f.IntVar(&b.shortTok, "short-tokens", 32, "tokens of the other requests")
	f.IntSliceVar(&b.levels, "levels", []int{1, 2}, "the Host's sleep levels to run")
	f.DurationVar(&b.sleep1, "sleep1-time", 372*time.Millisecond, "level-1 /sleep")
	f.DurationVar(&b.wake1, "wake1-time", 458*time.Millisecond, "level-1 /wake_up")
	f.DurationVar(&b.sleep2, "sleep2-time", 57*time.Millisecond, "level-2 /sleep")
	f.DurationVar(&b.wake2, "wake2-time", 45*time.Millisecond, "each level-2 /wake_up call (weights, then kv_cache)")
	f.DurationVar(&b.reload2, "reload-time", 2609*time.Millisecond, "level-2 reload_weights")
	f.DurationVar(&b.startup, "startup-time", 58*time.Second, "an engine's cold start")
	f.StringVar(&b.llamaSwap, "llama-swap", "", "the llama-swap binary to compare with (none: the Host only)")
	return cmd
}

// traceRequest is one request of the trace.
type traceRequest struct {
	at    time.Duration
	model string
	phase int
	first bool // the first of its phase
	req   loadgen.Request
}

func (b switchBench) modelName(i int) string { return fmt.Sprintf("model-%c", 'a'+i) }

func (b switchBench) trace() []traceRequest {
	var out []traceRequest
	n := 0
	for k := 0; k < b.phases; k++ {
		for at := time.Duration(0); at < b.phase; at += b.interval {
			seed := int64(n)
			r := loadgen.Request{Prompt: fmt.Sprintf("request %d of the trace: tell me about the weather", n), MaxTokens: b.shortTok, IgnoreEOS: true, Seed: &seed}
			if n%b.longEvery == b.longEvery-1 {
				r.MaxTokens = b.longTokens
			}
			out = append(out, traceRequest{at: time.Duration(k)*b.phase + at, model: b.modelName(k % b.models), phase: k, first: at == 0, req: r})
			n++
		}
	}
	return out
}

// traceResult is one system's run of the trace.
type traceResult struct {
	name      string
	streams   []loadgen.Stream
	wall      time.Duration
	switches  []float64 // the Host's switch durations, s
	drains    []float64 // the part of each spent draining the previous model, s
	firstTTFT []time.Duration
	ttft      []time.Duration
	failed    []string
}

// playTrace sends every request at its time to base and waits for all.
func playTrace(ctx context.Context, base string, trace []traceRequest) traceResult {
	res := traceResult{streams: make([]loadgen.Stream, len(trace))}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	t0 := time.Now()
	var wg sync.WaitGroup
	for i, tr := range trace {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case <-ctx.Done():
				return
			case <-time.After(time.Until(t0.Add(tr.at))):
			}
			res.streams[i] = loadgen.Run(ctx, loadgen.Config{BaseURL: base, Model: tr.model, Client: client}, []loadgen.Request{tr.req})[0]
		}()
	}
	wg.Wait()
	res.wall = time.Since(t0)
	for i, s := range res.streams {
		switch {
		case s.Err != nil:
			res.failed = append(res.failed, fmt.Sprintf("request %d (%s): %v", i, trace[i].model, s.Err))
		case s.Done != 1 || s.Usage == nil || s.Usage.CompletionTokens != trace[i].req.MaxTokens || len(s.Arrivals) == 0:
			res.failed = append(res.failed, fmt.Sprintf("request %d (%s): incomplete (%d [DONE], usage %+v)", i, trace[i].model, s.Done, s.Usage))
		default:
			ttft := s.Arrivals[0].Sub(s.Start)
			res.ttft = append(res.ttft, ttft)
			if trace[i].first {
				res.firstTTFT = append(res.firstTTFT, ttft)
			}
		}
	}
	return res
}

func runBenchSwitch(ctx context.Context, out io.Writer, b switchBench) error {
	if b.log == nil {
		b.log = zap.NewNop()
	}
	trace := b.trace()
	fmt.Fprintf(out, "vhi bench switch: %d models on one GPU, %d phases of %v, a request every %v (every %d-th %d tokens, else %d), %d requests; engines: vhi sim, start %v, level 1 sleep %v / wake %v, level 2 sleep %v / wake 2×%v + reload %v\n",
		b.models, b.phases, b.phase, b.interval, b.longEvery, b.longTokens, b.shortTok, len(trace), b.startup, b.sleep1, b.wake1, b.sleep2, b.wake2, b.reload2)
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "vhi-bench-switch-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var results []traceResult
	for _, level := range b.levels {
		r, err := b.runHost(ctx, exe, dir, level, trace)
		if err != nil {
			return fmt.Errorf("vllm-hi level %d: %w", level, err)
		}
		results = append(results, r)
		b.report(out, r)
	}
	if b.llamaSwap != "" {
		r, err := b.runLlamaSwap(ctx, exe, dir, trace)
		if err != nil {
			return fmt.Errorf("llama-swap: %w", err)
		}
		results = append(results, r)
		b.report(out, r)
	}
	for _, r := range results {
		if strings.HasPrefix(r.name, "vllm-hi") && len(r.failed) > 0 {
			return fmt.Errorf("%s: %d requests failed", r.name, len(r.failed))
		}
	}
	return nil
}

func (b switchBench) report(out io.Writer, r traceResult) {
	fmt.Fprintf(out, "%-18s %d/%d failed; TTFT p50 %s, p99 %s, max %s; first request of a phase p50 %s, max %s; trace done in %.1f s",
		r.name, len(r.failed), len(r.streams), msText(loadgen.Percentile(r.ttft, 0.5)), msText(loadgen.Percentile(r.ttft, 0.99)),
		msText(loadgen.Percentile(r.ttft, 1)), msText(loadgen.Percentile(r.firstTTFT, 0.5)), msText(loadgen.Percentile(r.firstTTFT, 1)), r.wall.Seconds())
	if len(r.switches) > 0 {
		rest := make([]float64, len(r.switches))
		for i := range rest {
			rest[i] = r.switches[i] - r.drains[i]
		}
		q := func(v []float64, p float64) float64 {
			v = append([]float64(nil), v...)
			sort.Float64s(v)
			return 1000 * v[min(len(v)-1, int(p*float64(len(v))))]
		}
		fmt.Fprintf(out, "; %d switches p50 %.0f ms, p99 %.0f ms, of which draining the previous model's requests p50 %.0f ms, p99 %.0f ms; the rest (sleep, wake, checks) p50 %.0f ms, p99 %.0f ms",
			len(r.switches), q(r.switches, 0.5), q(r.switches, 0.99), q(r.drains, 0.5), q(r.drains, 0.99), q(rest, 0.5), q(rest, 0.99))
	}
	fmt.Fprintln(out)
	if len(r.failed) > 0 {
		fmt.Fprintf(out, "  first failures: %s\n", strings.Join(r.failed[:min(3, len(r.failed))], "; "))
	}
}

// simArgs are a model's engine's flags (its port and served name set by
// the caller).
func (b switchBench) simArgs(level int, tokenFile string) []string {
	sleep, wake := b.sleep1, b.wake1
	if level == 2 {
		sleep, wake = b.sleep2, b.wake2
	}
	return []string{"--enable-sleep-mode", "--sleep-time", sleep.String(), "--wake-up-time", wake.String(),
		"--weights-load-time", b.reload2.String(), "--num-gpu-blocks", "4096", "--max-model-len", "2048",
		"--log-level", "warn", "--engine-token-file", tokenFile}
}

// runHost runs the trace through a Host in this process that switches
// the models' engines (started once: their cold start is not the trace's).
func (b switchBench) runHost(ctx context.Context, exe, dir string, level int, trace []traceRequest) (traceResult, error) {
	token := credentials.NewToken()
	tokenFile := filepath.Join(dir, fmt.Sprintf("agent-token-%d", level))
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		return traceResult{}, err
	}
	models := map[string]switching.Model{}
	var procs []*exec.Cmd
	defer func() { stopGroups(procs) }()
	for i := 0; i < b.models; i++ {
		name := b.modelName(i)
		port, err := pickPort()
		if err != nil {
			return traceResult{}, err
		}
		args := append([]string{"sim", "--port", fmt.Sprint(port), "--served-model-name", name}, b.simArgs(level, tokenFile)...)
		p, err := startLogged(exe, args, filepath.Join(dir, fmt.Sprintf("%s-%d.log", name, level)))
		if err != nil {
			return traceResult{}, err
		}
		procs = append(procs, p)
		models[name] = switching.Model{ServedModelName: name, BackendURL: fmt.Sprintf("http://127.0.0.1:%d", port), Group: "gpu0", SleepLevel: level}
	}
	for _, m := range models {
		if err := waitOK(ctx, m.BackendURL+"/health", time.Minute); err != nil {
			return traceResult{}, err
		}
	}
	cfg := host.DefaultConfig()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return traceResult{}, err
	}
	admin := credentials.NewToken()
	cfg.AdminToken, cfg.AgentToken = admin, token
	cfg.Models, cfg.Controller = models, switching.Controller{StartupAwakeModel: b.modelName(0)}
	h, err := host.New(cfg, b.log.Named("host"))
	if err != nil {
		ln.Close()
		return traceResult{}, err
	}
	hctx, stopHost := context.WithCancel(ctx)
	hdone := make(chan struct{})
	go func() { defer close(hdone); _ = h.Serve(hctx, ln) }()
	defer func() { stopHost(); <-hdone }()
	base := "http://" + ln.Addr().String()
	c, err := hostapi.New(base, hostapi.Options{AdminToken: admin})
	if err != nil {
		return traceResult{}, err
	}
	// Start-up: the first model awake, the others asleep.
	deadline := time.Now().Add(time.Minute)
	for {
		st, err := c.AdminState(ctx)
		ready := err == nil
		for name, m := range st.Models {
			ready = ready && ((name == b.modelName(0)) == (m.State == switching.StateAwake)) && m.State != switching.StateWaking
		}
		if ready {
			break
		}
		if time.Now().After(deadline) {
			return traceResult{}, fmt.Errorf("the models did not settle at start-up: %+v %v", st, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The switches, as the Host reports them, while the trace plays.
	seen := map[time.Time][2]float64{}
	pollDone := make(chan struct{})
	pctx, stopPoll := context.WithCancel(ctx)
	go func() {
		defer close(pollDone)
		for pctx.Err() == nil {
			if st, err := c.AdminState(pctx); err == nil {
				for _, m := range st.Models {
					if s := m.LastSwitch; s != nil && s.State == switching.OutcomeSucceeded {
						seen[s.StartedAt] = [2]float64{s.DurationS, s.DrainS}
					}
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	res := playTrace(ctx, base, trace)
	stopPoll()
	<-pollDone
	res.name = fmt.Sprintf("vllm-hi, level %d", level)
	for _, d := range seen {
		res.switches = append(res.switches, d[0])
		res.drains = append(res.drains, d[1])
	}
	return res, nil
}

// runLlamaSwap runs the trace through llama-swap starting and stopping
// the same engines.
func (b switchBench) runLlamaSwap(ctx context.Context, exe, dir string, trace []traceRequest) (traceResult, error) {
	tokenFile := filepath.Join(dir, "agent-token-ls")
	if err := os.WriteFile(tokenFile, []byte(credentials.NewToken()+"\n"), 0o600); err != nil {
		return traceResult{}, err
	}
	port, err := pickPort()
	if err != nil {
		return traceResult{}, err
	}
	var cfg strings.Builder
	fmt.Fprintf(&cfg, "healthCheckTimeout: %d\nstartPort: %d\nlogLevel: warn\nmodels:\n", int(b.startup.Seconds())+120, port+1)
	for i := 0; i < b.models; i++ {
		name := b.modelName(i)
		args := append([]string{exe, "sim", "--port", "${PORT}", "--served-model-name", name, "--startup-time", b.startup.String()}, b.simArgs(1, tokenFile)...)
		// concurrencyLimit lifted: its default of 10 answers the trace's
		// queued requests with 429s, which would measure the limit, not
		// the swapping.
		fmt.Fprintf(&cfg, "  %s:\n    cmd: %q\n    proxy: \"http://127.0.0.1:${PORT}\"\n    checkEndpoint: /health\n    concurrencyLimit: 100000\n", name, strings.Join(args, " "))
	}
	cfgFile := filepath.Join(dir, "llama-swap.yaml")
	if err := os.WriteFile(cfgFile, []byte(cfg.String()), 0o600); err != nil {
		return traceResult{}, err
	}
	p, err := startLogged(b.llamaSwap, []string{"--config", cfgFile, "--listen", fmt.Sprintf("127.0.0.1:%d", port)}, filepath.Join(dir, "llama-swap.log"))
	if err != nil {
		return traceResult{}, err
	}
	defer stopGroups([]*exec.Cmd{p})
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	if err := waitOK(ctx, base+"/v1/models", 30*time.Second); err != nil {
		return traceResult{}, err
	}
	// The first model started before the trace, as the Host's engines
	// are: a cold start is not what the trace measures.
	warm := loadgen.Run(ctx, loadgen.Config{BaseURL: base, Model: trace[0].model}, []loadgen.Request{{Prompt: "warm up", MaxTokens: 1}})[0]
	if warm.Err != nil {
		return traceResult{}, fmt.Errorf("starting %s before the trace: %w", trace[0].model, warm.Err)
	}
	res := playTrace(ctx, base, trace)
	res.name = "llama-swap"
	return res, nil
}

// startLogged runs exe in its own process group, its output to logFile.
func startLogged(exe string, args []string, logFile string) (*exec.Cmd, error) {
	f, err := os.Create(logFile)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(exe, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	go func() { _ = cmd.Wait(); f.Close() }()
	return cmd, nil
}

// stopGroups ends each process group: SIGTERM, SIGKILL after 10 s.
func stopGroups(procs []*exec.Cmd) {
	for _, p := range procs {
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
	}
	for _, p := range procs {
		deadline := time.Now().Add(10 * time.Second)
		for syscall.Kill(-p.Process.Pid, 0) == nil && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
	}
}

// waitOK waits until url answers 200.
func waitOK(ctx context.Context, url string, within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		if resp, err := http.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not answer 200 within %v", url, within)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

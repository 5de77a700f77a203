package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

func newBenchUpstreamCommand() *cobra.Command {
	var (
		port     int
		interval time.Duration
		model    string
		spread   bool
	)
	cmd := &cobra.Command{
		Use:    "sse-upstream",
		Short:  "Serve a tick-driven OpenAI streaming upstream for proxy benchmarks",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			u := loadgen.NewTickUpstream(model, interval, spread)
			defer u.Close()
			ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
			if err != nil {
				return err
			}
			srv := &http.Server{Handler: u, ReadHeaderTimeout: 10 * time.Second}
			go func() { <-cmd.Context().Done(); _ = srv.Close() }()
			if err := srv.Serve(ln); err != http.ErrServerClosed {
				return err
			}
			return nil
		},
	}
	cmd.Flags().IntVar(&port, "port", 0, "port")
	cmd.Flags().DurationVar(&interval, "interval", 40*time.Millisecond, "time between two tokens of a stream (one engine step)")
	cmd.Flags().StringVar(&model, "model", "bench", "served model name")
	cmd.Flags().BoolVar(&spread, "spread", false, "each stream ticks at its own phase instead of all at once")
	return cmd
}

type proxyBenchConfig struct {
	levels   []int
	tokens   int
	interval time.Duration
	nginx    string // "auto", "on", "off"
	// extra: another proxy's command line, {listen} and {upstream} in it
	// replaced with its listen and upstream addresses.
	extra string
	// eventLoop: also run a Host with --relay-event-loop.
	eventLoop bool
	jsonOut   string
	spread    bool
	// hostProfile: write a CPU profile of the Host during its first path.
	hostProfile string
	debugPort   int
	// loopDebugPort serves the event-loop Host's pprof.
	loopDebugPort int
}

// debugAddr is where the Host under test serves pprof (loop: the Host
// with the event loop, on the next port).
func (c *proxyBenchConfig) debugAddr(loop bool) string {
	if loop {
		return fmt.Sprintf("127.0.0.1:%d", c.loopDebugPort)
	}
	return fmt.Sprintf("127.0.0.1:%d", c.debugPort)
}

func newBenchProxyCommand() *cobra.Command {
	c := proxyBenchConfig{}
	cmd := &cobra.Command{
		Use:   "proxy",
		Short: "Compare the Host's SSE proxy with streaming directly and with nginx",
		Long: `Starts a tick-driven streaming upstream (one token per stream every --interval,
stamped with its send time), vhi host with a vhi agent registering that upstream, and
nginx (Debian's package; proxy_buffering off, upstream keep-alive) on loopback, then for
each stream count in --levels runs the same load directly, through the Host and through
nginx, one after the other. Per path it reports per-token delivery latency (arrival −
send) p50/p99/max, the latency each proxy adds over direct (p50 and p99 differences),
delivered tokens/s, completed streams, and the proxy process's CPU.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchProxy(cmd.Context(), cmd.OutOrStdout(), c)
		},
	}
	cmd.Flags().IntSliceVar(&c.levels, "levels", []int{1000, 2000, 4000}, "concurrent stream counts to run")
	cmd.Flags().IntVar(&c.tokens, "tokens", 150, "tokens per stream")
	cmd.Flags().DurationVar(&c.interval, "interval", 40*time.Millisecond, "time between two tokens of a stream")
	cmd.Flags().StringVar(&c.nginx, "nginx", "auto", "compare with nginx: auto (when installed), on, off")
	cmd.Flags().StringVar(&c.extra, "extra-proxy", "", "also run this proxy command (its {listen} and {upstream} replaced by host:port), as path \"extra\"; e.g. hack/relayfloor")
	cmd.Flags().BoolVar(&c.eventLoop, "event-loop", true, "also run a second Host with --relay-event-loop, as path \"vhi host, event loop\"")
	cmd.Flags().StringVar(&c.jsonOut, "json", "", "also write the results as JSON to this file")
	cmd.Flags().BoolVar(&c.spread, "spread", false, "streams tick at their own phases (no per-step burst)")
	cmd.Flags().StringVar(&c.hostProfile, "host-cpuprofile", "", "write a CPU profile of the Host over its first level's run to this file (the event-loop Host's: FILE.event-loop)")
	return cmd
}

// proc is a child process the benchmark owns.
type benchProc struct {
	cmd  *exec.Cmd
	name string
}

func startProc(ctx context.Context, name string, bin string, args ...string) (*benchProc, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return &benchProc{cmd: cmd, name: name}, nil
}

func (p *benchProc) stop() {
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = p.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-done
	}
}

// cpuOfTree is the CPU seconds of pid and its direct children (nginx's
// workers).
func cpuOfTree(pid int) float64 {
	total, _ := cpuSeconds(pid)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", pid, pid))
	if err == nil {
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				s, _ := cpuSeconds(c)
				total += s
			}
		}
	}
	return total
}

func pickPort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func waitHTTP(url string, ok func(*http.Response) bool) error {
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(url); err == nil {
			good := ok(resp)
			resp.Body.Close()
			if good {
				return nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("%s not ready", url)
}

const nginxConf = `worker_processes auto;
worker_rlimit_nofile 65535;
daemon off;
pid %[1]s/nginx.pid;
error_log %[1]s/error.log warn;
events { worker_connections 16384; multi_accept on; }
http {
  access_log off;
  client_body_temp_path %[1]s/body;
  proxy_temp_path %[1]s/proxy;
  fastcgi_temp_path %[1]s/fastcgi;
  uwsgi_temp_path %[1]s/uwsgi;
  scgi_temp_path %[1]s/scgi;
  upstream engine { server 127.0.0.1:%[2]d; keepalive 1024; }
  server {
    listen 127.0.0.1:%[3]d;
    location / {
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_cache off;
      proxy_read_timeout 3600s;
    }
  }
}
`

// startHost starts a Host (args added to its command line) and an agent
// registering the upstream at upURL with it, each with state and tokens
// of their own, so that the benchmark neither needs nor touches a Host
// already on this machine; debug: serve pprof on debugAddr.
func (c *proxyBenchConfig) startHost(ctx context.Context, exe, upURL string, debugAddr string, args ...string) (url string, pid int, stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	defer func() {
		if err != nil {
			stop()
		}
	}()
	hostPort, _ := pickPort()
	stateDir, err := os.MkdirTemp("", "vhi-bench-proxy-")
	if err != nil {
		return "", 0, stop, err
	}
	stops = append(stops, func() { os.RemoveAll(stateDir) })
	admin, agentToken := credentials.NewToken(), credentials.NewToken()
	adminFile, agentFile := filepath.Join(stateDir, "admin-token"), filepath.Join(stateDir, "agent-token")
	for f, tok := range map[string]string{adminFile: admin, agentFile: agentToken} {
		if err := os.WriteFile(f, []byte(tok+"\n"), 0o600); err != nil {
			return "", 0, stop, err
		}
	}
	hostAddr := fmt.Sprintf("127.0.0.1:%d", hostPort)
	hostArgs := append([]string{"host", "--listen", hostAddr, "--log-level", "warn", "--data-dir", filepath.Join(stateDir, "host"),
		"--admin-token-file", adminFile, "--agent-token-file", agentFile}, args...)
	if debugAddr != "" {
		hostArgs = append(hostArgs, "--debug-addr", debugAddr)
	}
	h, err := startProc(ctx, "host", exe, hostArgs...)
	if err != nil {
		return "", 0, stop, err
	}
	stops = append(stops, h.stop)
	ag, err := startProc(ctx, "agent", exe, "agent", "--type", "A", "--host", hostAddr, "--engine", upURL, "--log-level", "warn",
		"--token-file", agentFile)
	if err != nil {
		return "", 0, stop, err
	}
	stops = append(stops, ag.stop)
	url = "http://" + hostAddr
	hc, err := hostapi.New(url, hostapi.Options{Timeout: 2 * time.Second, AdminToken: admin})
	if err != nil {
		return "", 0, stop, err
	}
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	err = hc.WaitInstances(wctx, 1)
	wcancel()
	if err != nil {
		return "", 0, stop, fmt.Errorf("the agent did not register: %w", err)
	}
	return url, h.cmd.Process.Pid, stop, nil
}

// benchPath is one way to the upstream the benchmark runs its load over
// (pid: the proxy's process, whose CPU is measured; 0: none).
type benchPath struct {
	name string
	url  string
	pid  int
}

// pathResult is one (level, path) measurement.
type pathResult struct {
	Level        int     `json:"streams"`
	Path         string  `json:"path"`
	Completed    int     `json:"completed"`
	Tokens       int     `json:"tokens"`
	TokensPerSec float64 `json:"tokens_per_sec"`
	OfferedTPS   float64 `json:"offered_tokens_per_sec"`
	P50ms        float64 `json:"latency_p50_ms"`
	P99ms        float64 `json:"latency_p99_ms"`
	Maxms        float64 `json:"latency_max_ms"`
	AddedP50ms   float64 `json:"added_p50_ms"`
	AddedP99ms   float64 `json:"added_p99_ms"`
	ProxyCores   float64 `json:"proxy_cpu_cores"`
	// CPUPerEventus is the proxy's CPU per relayed token event.
	CPUPerEventus float64 `json:"proxy_cpu_us_per_event"`
	Errors        int     `json:"errors"`
}

func runBenchProxy(ctx context.Context, out io.Writer, c proxyBenchConfig) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	upPort, _ := pickPort()
	c.debugPort, _ = pickPort()
	c.loopDebugPort, _ = pickPort()
	debugAddr := func(loop bool) string {
		if c.hostProfile == "" {
			return ""
		}
		return c.debugAddr(loop)
	}
	up, err := startProc(ctx, "upstream", exe, "bench", "sse-upstream", "--port", strconv.Itoa(upPort), "--interval", c.interval.String(),
		"--spread="+strconv.FormatBool(c.spread))
	if err != nil {
		return err
	}
	defer up.stop()
	upURL := fmt.Sprintf("http://127.0.0.1:%d", upPort)
	if err := waitHTTP(upURL+"/health", func(r *http.Response) bool { return r.StatusCode == 200 }); err != nil {
		return err
	}
	hostURL, hostPID, stopHost, err := c.startHost(ctx, exe, upURL, debugAddr(false))
	if err != nil {
		return err
	}
	defer stopHost()
	paths := []benchPath{{"direct", upURL, 0}, {"vhi host", hostURL, hostPID}}
	if c.eventLoop {
		// The same Host with the relay's event loop, side by side.
		loopURL, loopPID, stopLoopHost, err := c.startHost(ctx, exe, upURL, debugAddr(true), "--relay-event-loop")
		if err != nil {
			return err
		}
		defer stopLoopHost()
		paths = append(paths, benchPath{"vhi host, event loop", loopURL, loopPID})
	}
	nginxBin, lookErr := exec.LookPath("nginx")
	if lookErr != nil {
		nginxBin = "/usr/sbin/nginx"
		if _, err := os.Stat(nginxBin); err != nil {
			nginxBin = ""
		}
	}
	switch {
	case c.nginx == "off":
	case nginxBin == "" && c.nginx == "on":
		return fmt.Errorf("nginx not installed (Debian: apt-get install nginx-light)")
	case nginxBin == "":
		fmt.Fprintln(out, "nginx not installed: comparing with direct only (make bench-proxy installs it)")
	default:
		dir, err := os.MkdirTemp("", "vhi-bench-nginx-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		nport, _ := pickPort()
		conf := filepath.Join(dir, "nginx.conf")
		if err := os.WriteFile(conf, []byte(fmt.Sprintf(nginxConf, dir, upPort, nport)), 0o644); err != nil {
			return err
		}
		ng, err := startProc(ctx, "nginx", nginxBin, "-p", dir, "-c", conf)
		if err != nil {
			return err
		}
		defer ng.stop()
		nURL := fmt.Sprintf("http://127.0.0.1:%d", nport)
		if err := waitHTTP(nURL+"/health", func(r *http.Response) bool { return r.StatusCode == 200 }); err != nil {
			return fmt.Errorf("nginx: %w", err)
		}
		paths = append(paths, benchPath{"nginx", nURL, ng.cmd.Process.Pid})
	}

	if c.extra != "" {
		xport, _ := pickPort()
		listen, upstream := fmt.Sprintf("127.0.0.1:%d", xport), fmt.Sprintf("127.0.0.1:%d", upPort)
		args := strings.Fields(strings.NewReplacer("{listen}", listen, "{upstream}", upstream).Replace(c.extra))
		if len(args) == 0 {
			return fmt.Errorf("--extra-proxy: no command")
		}
		x, err := startProc(ctx, "extra proxy", args[0], args[1:]...)
		if err != nil {
			return err
		}
		defer x.stop()
		xURL := "http://" + listen
		if err := waitHTTP(xURL+"/health", func(r *http.Response) bool { return r.StatusCode == 200 }); err != nil {
			return fmt.Errorf("extra proxy: %w", err)
		}
		paths = append(paths, benchPath{"extra", xURL, x.cmd.Process.Pid})
	}

	mode := "all streams tick together (one burst per engine step)"
	if c.spread {
		mode = "each stream ticks at its own phase (no bursts)"
	}
	fmt.Fprintf(out, "vhi bench proxy: %d tokens per stream, one token per stream every %v, %s; paths run one after another\n", c.tokens, c.interval, mode)
	var results []pathResult
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "streams\tpath\tcompleted\ttok/s\toffered\tp50 ms\tp99 ms\tmax ms\tadded p50\tadded p99\tproxy CPU\tCPU us/event\t")
	for _, n := range c.levels {
		var direct pathResult
		for _, p := range paths {
			cpu0 := 0.0
			if p.pid > 0 {
				cpu0 = cpuOfTree(p.pid)
			}
			var profiled chan error
			if strings.HasPrefix(p.name, "vhi host") && c.hostProfile != "" && n == c.levels[0] {
				profiled = make(chan error, 1)
				loop := p.name != "vhi host"
				go func() { profiled <- c.profileHost(ctx, loop) }()
			}
			r := loadgen.RunLatency(ctx, p.url+"/v1/completions", "bench", n, c.tokens, time.Second)
			if profiled != nil {
				if err := <-profiled; err != nil {
					return err
				}
			}
			pr := pathResult{Level: n, Path: p.name, Completed: r.Completed, Tokens: r.Tokens, TokensPerSec: r.TokensPerSec(),
				OfferedTPS: float64(n) / c.interval.Seconds(), Errors: len(r.Errors)}
			pr.P50ms = ms(loadgen.Percentile(r.Latencies, 0.5))
			pr.P99ms = ms(loadgen.Percentile(r.Latencies, 0.99))
			pr.Maxms = ms(loadgen.Percentile(r.Latencies, 1))
			if p.pid > 0 {
				pr.ProxyCores = (cpuOfTree(p.pid) - cpu0) / r.Wall.Seconds()
				if r.Tokens > 0 {
					pr.CPUPerEventus = (cpuOfTree(p.pid) - cpu0) / float64(r.Tokens) * 1e6
				}
			}
			if p.name == "direct" {
				direct = pr
			} else {
				pr.AddedP50ms, pr.AddedP99ms = pr.P50ms-direct.P50ms, pr.P99ms-direct.P99ms
			}
			results = append(results, pr)
			fmt.Fprintf(tw, "%d\t%s\t%d/%d\t%.0f\t%.0f\t%.2f\t%.2f\t%.1f\t%.3f\t%.3f\t%.2f\t%.1f\t\n", n, p.name, pr.Completed, n,
				pr.TokensPerSec, pr.OfferedTPS, pr.P50ms, pr.P99ms, pr.Maxms, pr.AddedP50ms, pr.AddedP99ms, pr.ProxyCores, pr.CPUPerEventus)
			_ = tw.Flush()
			time.Sleep(500 * time.Millisecond)
		}
	}
	if c.jsonOut != "" {
		b, _ := json.MarshalIndent(results, "", "  ")
		if err := os.WriteFile(c.jsonOut, b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// profileHost takes a CPU profile of the Host under test while a level
// runs: from its ramp's end to just before its last tokens.
func (c *proxyBenchConfig) profileHost(ctx context.Context, loop bool) error {
	seconds := int((time.Duration(c.tokens)*c.interval - time.Second) / time.Second)
	if seconds < 1 {
		seconds = 1
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(time.Second):
	}
	url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", c.debugAddr(loop), seconds)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("profile the Host: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("profile the Host: HTTP %d", resp.StatusCode)
	}
	file := c.hostProfile
	if loop {
		file += ".event-loop"
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("profile the Host: %w", err)
	}
	return f.Close()
}

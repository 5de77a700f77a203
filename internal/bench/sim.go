package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

func newBenchSimCommand(_ *Options) *cobra.Command {
	var (
		streams, maxTokens, promptWords int
		simArgs                         []string
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Measure the sim's own CPU cost under a full streaming load",
		Long: `Starts "vhi sim" with its defaults as a child process, streams --streams
concurrent requests through it and reports the sim process's CPU use (from
/proc), the achieved step time and tokens per second. The point: the sim is
not the bottleneck of any benchmark built on it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchSim(cmd.Context(), cmd.OutOrStdout(), streams, maxTokens, promptWords, simArgs)
		},
	}
	cmd.Flags().IntVar(&streams, "streams", 256, "concurrent streams")
	cmd.Flags().IntVar(&maxTokens, "max-tokens", 512, "tokens per stream (ignore_eos)")
	cmd.Flags().IntVar(&promptWords, "prompt-words", 200, "approximate prompt length in tokens")
	cmd.Flags().StringSliceVar(&simArgs, "sim-arg", nil, "extra flag for the child vhi sim (repeatable)")
	return cmd
}

// startChildSim starts "vhi sim" as a child process on a free port with
// its KV in /dev/shm and waits for it to be healthy.
func startChildSim(ctx context.Context, args ...string) (*benchProc, string, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, "", err
	}
	port, err := pickPort()
	if err != nil {
		return nil, "", err
	}
	all := append([]string{"sim", "--port", strconv.Itoa(port), "--log-level", "warn", "--shm-dir", os.TempDir()}, args...)
	if _, err := os.Stat("/dev/shm"); err == nil {
		all = append(all, "--shm-dir", "/dev/shm")
	}
	p, err := startProc(ctx, "sim", exe, all...)
	if err != nil {
		return nil, "", err
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	if err := waitHTTP(url+"/health", func(r *http.Response) bool { return r.StatusCode == http.StatusOK }); err != nil {
		p.stop()
		return nil, "", fmt.Errorf("vhi sim: %w", err)
	}
	return p, url, nil
}

// cpuSeconds is the user+system CPU time of pid so far.
func cpuSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the parenthesised command name; utime and stime are the
	// 14th and 15th fields of the whole line.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / 100, nil // USER_HZ is 100 on Linux
}

// scrape returns the sum and count of a histogram (or a counter's value as
// sum) from a Prometheus text endpoint.
func scrape(url, name string) (sum, count float64, err error) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		val := func() float64 {
			v, _ := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			return v
		}
		switch {
		case strings.HasPrefix(line, name+"_sum"):
			sum = val()
		case strings.HasPrefix(line, name+"_count"):
			count = val()
		case strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" "):
			sum = val()
		}
	}
	return sum, count, sc.Err()
}

func runBenchSim(ctx context.Context, out io.Writer, streams, maxTokens, promptWords int, simArgs []string) error {
	child, url, err := startChildSim(ctx, simArgs...)
	if err != nil {
		return err
	}
	defer child.stop()
	words := []string{"hello", "world", "model", "token", "stream"}
	reqs := make([]loadgen.Request, streams)
	for i := range reqs {
		p := fmt.Sprintf("bench %d", i)
		for j := 0; j < promptWords; j++ {
			p += " " + words[(i+j)%len(words)]
		}
		reqs[i] = loadgen.Request{Prompt: p, MaxTokens: maxTokens, IgnoreEOS: true}
	}
	cpu0, err := cpuSeconds(child.cmd.Process.Pid)
	if err != nil {
		return fmt.Errorf("read sim CPU: %w", err)
	}
	t0 := time.Now()
	res := loadgen.Run(ctx, loadgen.Config{BaseURL: url, Model: "Qwen/Qwen3-8B"}, reqs)
	wall := time.Since(t0)
	cpu1, _ := cpuSeconds(child.cmd.Process.Pid)
	sum := loadgen.Summarize(res, wall)
	if sum.Failed > 0 {
		for _, s := range res {
			if s.Err != nil {
				return fmt.Errorf("%d streams failed, first: %w", sum.Failed, s.Err)
			}
		}
	}
	modelled, steps, _ := scrape(url+"/metrics", "vhi_sim_step_modelled_seconds")
	compute, _, _ := scrape(url+"/metrics", "vhi_sim_step_compute_seconds")
	cores := (cpu1 - cpu0) / wall.Seconds()
	var lay hooks.Layout
	if resp, err := http.Get(url + hooks.PathLayout); err == nil {
		_ = json.NewDecoder(resp.Body).Decode(&lay)
		resp.Body.Close()
	}
	fmt.Fprintf(out, "vhi bench sim: %d streams × %d tokens (prompt ≈ %d tokens), sim defaults %v\n", streams, maxTokens, promptWords, simArgs)
	fmt.Fprintf(out, "  KV geometry          %d layers × %d KV heads × head dim %d, %d B/token, %d blocks\n",
		lay.Geometry.Layers, lay.Geometry.KVHeads, lay.Geometry.HeadDim, lay.Geometry.TokenBytes(), lay.Geometry.NumBlocks)
	fmt.Fprintf(out, "  wall                 %.2f s\n", wall.Seconds())
	fmt.Fprintf(out, "  tokens streamed      %d (%.0f tok/s)\n", sum.Tokens, sum.TokensPerSec)
	fmt.Fprintf(out, "  steps                %.0f, modelled mean %.1f ms, compute mean %.2f ms\n", steps, 1000*modelled/steps, 1000*compute/steps)
	fmt.Fprintf(out, "  inter-token gap      p50 %v, p99 %v\n", sum.GapP50.Round(100*time.Microsecond), sum.GapP99.Round(100*time.Microsecond))
	fmt.Fprintf(out, "  sim CPU              %.2f cores (%.1f CPU-s over %.1f s)\n", cores, cpu1-cpu0, wall.Seconds())
	return nil
}

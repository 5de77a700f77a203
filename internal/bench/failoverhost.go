package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sort"
	"strings"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/hostmetrics"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// failoverHostFlags run vhi bench failover against a running deployment.
type failoverHostFlags struct {
	host, model, adminTokenFile, agentTokenFile, kill string
}

// runBenchFailoverHost streams the load through a running Host twice:
// once as the reference, once with the active instance running the most
// streams killed after the delay by the user's command (the deployment's
// Host has failover as it was started: its flags decide the mode). Every
// stream is compared with its reference: exact only on engines whose
// output is the same in every batch (real vLLM: a random-weight
// checkpoint and VLLM_BATCH_INVARIANT=1).
func runBenchFailoverHost(ctx context.Context, out io.Writer, o opsBench, x failoverHostFlags) error {
	admin, err := credentials.Resolve(x.adminTokenFile, credentials.AdminTokenFile, "--admin-token-file", true)
	if err != nil {
		return err
	}
	agent, err := credentials.Resolve(x.agentTokenFile, credentials.AgentTokenFile, "--agent-token-file", true)
	if err != nil {
		return err
	}
	c, err := hostapi.New(x.host, hostapi.Options{AdminToken: admin, Timeout: 30 * time.Second})
	if err != nil {
		return err
	}
	actives, model, err := activeInstances(ctx, c, x.model)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "vhi bench failover --host %s: %d streams × %d tokens of %s over %d active instances; the busiest killed after %v by %q\n",
		x.host, o.streams, o.maxTokens, model, len(actives), o.delay, x.kill)
	reqs := scenario{Streams: o.streams, MaxTokens: o.maxTokens, PromptWords: o.promptWords, Greedy: true}.requests()
	ref := loadgen.Run(ctx, loadgen.Config{BaseURL: x.host, Model: model}, reqs)
	for i, s := range ref {
		if s.Err != nil {
			return fmt.Errorf("reference run, stream %d: %w", i, s.Err)
		}
	}
	before := failoverCounts(x.host)
	done := make(chan []loadgen.Stream, 1)
	t0 := time.Now()
	go func() { done <- loadgen.Run(ctx, loadgen.Config{BaseURL: x.host, Model: model}, reqs) }()
	if err := wait(ctx, o.delay); err != nil {
		return err
	}
	victim, ids, err := busiest(ctx, c, model, agent)
	if err != nil {
		return err
	}
	if len(ids) == 0 {
		return fmt.Errorf("no engine ran a stream %v after the load began: a shorter --delay, or longer streams", o.delay)
	}
	warm := hostMetric(x.host, "vhi_failover_warm_copies")
	cmd := exec.CommandContext(ctx, "sh", "-c", x.kill)
	cmd.Env = append(os.Environ(), "VHI_VICTIM_ID="+victim.ID, "VHI_VICTIM_URL="+victim.EngineURL)
	killed := time.Now()
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("--kill %q: %v: %s", x.kill, err, b)
	}
	streams := <-done
	r := crashMetrics(streams, reqs, ref, ids, killed, t0)
	after := failoverCounts(x.host)
	fmt.Fprintf(out, "killed %s (%s, %d requests on it) %s after the load began\n", victim.ID, victim.EngineURL, len(ids), killed.Sub(t0).Round(time.Millisecond))
	r.warmCopies, r.warmRecovered = int(warm), int(after["warm"]-before["warm"])
	r.warmBytes = int64(hostMetric(x.host, "vhi_failover_warm_bytes_total"))
	fmt.Fprintf(out, "host          %s\n", r.report(warm > 0))
	fmt.Fprintf(out, "the Host's failovers in the run: %s\n", countsDiff(before, after))
	if r.check.Failed > 0 || r.check.Inexact > 0 {
		return fmt.Errorf("failover run with failed or inexact streams (%s)", r.check)
	}
	return nil
}

// activeInstances are the Host's active migratable instances of model (or
// of the first such instance's model), at least two.
func activeInstances(ctx context.Context, c *hostapi.Client, model string) ([]hostapi.Instance, string, error) {
	list, err := c.Instances(ctx)
	if err != nil {
		return nil, "", fmt.Errorf("the Host's instances: %w", err)
	}
	var out []hostapi.Instance
	for _, in := range list {
		if in.Migratable && in.Role == "active" && (model == "" || in.ServedModelName == model) {
			if model == "" {
				model = in.ServedModelName
			}
			out = append(out, in)
		}
	}
	if len(out) < 2 {
		return nil, "", fmt.Errorf("the Host has %d active migratable instances of %q: a failover needs a survivor", len(out), model)
	}
	return out, model, nil
}

// busiest is the active instance of model whose engine runs the most
// requests now (asked directly: the heartbeats' counts lag), and the ids
// of those requests.
func busiest(ctx context.Context, c *hostapi.Client, model, agentToken string) (hostapi.Instance, map[string]bool, error) {
	actives, _, err := activeInstances(ctx, c, model)
	if err != nil {
		return hostapi.Instance{}, nil, err
	}
	var best hostapi.Instance
	var bestIDs map[string]bool
	for _, in := range actives {
		ec, err := engine.NewClient(in.EngineURL, engine.Options{Token: agentToken})
		if err != nil {
			return best, nil, err
		}
		list, err := ec.Requests(ctx)
		if err != nil {
			return best, nil, fmt.Errorf("the requests of %s: %w", in.ID, err)
		}
		ids := map[string]bool{}
		for _, q := range list.Requests {
			if q.Status == hooks.StatusRunning {
				ids[q.RequestID] = true
			}
		}
		if bestIDs == nil || len(ids) > len(bestIDs) {
			best, bestIDs = in, ids
		}
	}
	return best, bestIDs, nil
}

// failoverCounts is the Host's vhi_failovers_total by outcome (none when
// it cannot be read).
func failoverCounts(hostURL string) map[string]float64 {
	out, _ := hostmetrics.ByLabel(hostURL, "vhi_failovers_total", "outcome")
	return out
}

// hostMetric is a Host's metric, 0 when absent or unreadable.
func hostMetric(hostURL, name string) float64 {
	v, _ := hostmetrics.Value(hostURL, name)
	return v
}

func countsDiff(before, after map[string]float64) string {
	var parts []string
	for k, v := range after {
		if d := v - before[k]; d > 0 {
			parts = append(parts, fmt.Sprintf("%s %.0f", k, d))
		}
	}
	sort.Strings(parts)
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

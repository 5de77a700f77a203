package autoscale

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/slo"
)

// fakeScaler records the operations asked of it; each runs until ended.
type fakeScaler struct {
	replicas []registry.Instance
	sizes    map[string]int
	asked    []hostapi.ScaleRequest
	causes   []string
	ops      map[string]hostapi.ScaleStatus
	refuse   error
}

func (f *fakeScaler) StartFor(req hostapi.ScaleRequest, cause string) (string, error) {
	if f.refuse != nil {
		return "", f.refuse
	}
	f.asked, f.causes = append(f.asked, req), append(f.causes, cause)
	id := fmt.Sprintf("scale-%d", len(f.asked))
	f.ops[id] = hostapi.ScaleStatus{ID: id, State: hostapi.StateRunning}
	return id, nil
}
func (f *fakeScaler) Get(id string) (hostapi.ScaleStatus, bool) { s, ok := f.ops[id]; return s, ok }
func (f *fakeScaler) Replicas(string) []registry.Instance       { return f.replicas }
func (f *fakeScaler) Size(id string) int                        { return f.sizes[id] }
func (f *fakeScaler) end(id string, at time.Time) {
	s := f.ops[id]
	s.State, s.FinishedAt = "succeeded", at
	f.ops[id] = s
}
func (f *fakeScaler) setReplicas(n, waitingEach int) {
	f.replicas = nil
	for i := range n {
		f.replicas = append(f.replicas, registry.Instance{Registration: registry.Registration{ID: fmt.Sprint("r", i)}, Stats: registry.Stats{Waiting: waitingEach}})
	}
}

type rig struct {
	t   *testing.T
	a   *Autoscaler
	f   *fakeScaler
	w   *slo.Window
	now time.Time
}

func newRig(t *testing.T, p Policy, dry bool) *rig {
	cfg := Config{DryRun: dry, Models: map[string]Policy{"m": p}}
	if err := cfg.Check(); err != nil {
		t.Fatal(err)
	}
	r := &rig{t: t, f: &fakeScaler{sizes: map[string]int{}, ops: map[string]hostapi.ScaleStatus{}}, w: slo.New(cfg.Window(), cfg.Penalty()), now: time.Unix(10000, 0)}
	r.a = New(cfg, r.f, r.w, NewMetrics(), zap.NewNop())
	r.a.now = func() time.Time { return r.now }
	return r
}

// traffic records n requests over the last second with the given TTFT.
func (r *rig) traffic(n int, ttft time.Duration) {
	for i := range n {
		r.w.Observe("m", r.now.Add(-time.Second+time.Duration(i)*time.Second/time.Duration(n)), ttft)
	}
}

func (r *rig) step() []hostapi.AutoscaleDecision { return r.a.Step() }

func TestScalesOutOnTheSLOThenRestsThenIn(t *testing.T) {
	r := newRig(t, Policy{Min: 1, Max: 3, SLOS: 1, WindowS: 10, CooldownS: 30}, false)
	r.f.setReplicas(1, 0)
	r.traffic(10, 900*time.Millisecond)
	if d := r.step(); len(d) != 0 {
		t.Fatalf("10 requests (min_samples 20) decided %+v", d)
	}
	r.traffic(20, 900*time.Millisecond)
	d := r.step()
	if len(d) != 1 || d[0].Direction != "out" || d[0].Reason != ReasonTTFT || d[0].From != 1 || d[0].To != 2 || d[0].ScaleID != "scale-1" ||
		*r.f.asked[0].Replicas != 2 || r.f.asked[0].Model != "m" || r.f.causes[0] != "autoscaler" {
		t.Fatalf("p95 0.9 s against a 1 s SLO × 0.6: %+v %+v", d, r.f.asked)
	}
	// While it runs, and through the cooldown after it, nothing more.
	r.now = r.now.Add(5 * time.Second)
	if d := r.step(); len(d) != 0 || r.a.Status().Models[0].Scaling != "scale-1" {
		t.Fatalf("while scaling: %+v %+v", d, r.a.Status().Models)
	}
	r.f.end("scale-1", r.now)
	r.f.setReplicas(2, 0)
	r.now = r.now.Add(20 * time.Second)
	r.traffic(30, 900*time.Millisecond)
	if d := r.step(); len(d) != 0 || r.a.Status().Models[0].CoolingUntil.IsZero() {
		t.Fatalf("in the cooldown: %+v", d)
	}
	// Fast again, nothing waiting: in, after the cooldown.
	r.now = r.now.Add(11 * time.Second)
	r.traffic(30, 50*time.Millisecond)
	d = r.step()
	if len(d) != 1 || d[0].Direction != "in" || d[0].Reason != ReasonTTFTLow || d[0].To != 1 || *r.f.asked[1].Replicas != 1 {
		t.Fatalf("p95 50 ms: %+v", d)
	}
	st := r.a.Status()
	if len(st.Decisions) != 2 || st.Decisions[0].Direction != "in" || !st.Enabled {
		t.Fatalf("status %+v", st)
	}
}

func TestQueueBoundsAndWaitingHoldScaleIn(t *testing.T) {
	r := newRig(t, Policy{Min: 1, Max: 2, SLOS: 1, QueueHigh: 4, CooldownS: 1}, false)
	r.f.setReplicas(1, 5) // 5 waiting on one replica > 4
	d := r.step()
	if len(d) != 1 || d[0].Reason != ReasonQueue || d[0].To != 2 || !strings.Contains(d[0].Detail, "5 requests waiting") {
		t.Fatalf("a queue of 5: %+v", d)
	}
	r.f.end("scale-1", r.now)
	r.now = r.now.Add(2 * time.Second)
	r.f.setReplicas(2, 10)
	if d := r.step(); len(d) != 0 {
		t.Fatalf("at max: %+v", d)
	}
	// Fast but with requests waiting: no scale-in.
	r.f.setReplicas(2, 1)
	r.traffic(30, 10*time.Millisecond)
	if d := r.step(); len(d) != 0 {
		t.Fatalf("scale-in with requests waiting: %+v", d)
	}
}

func TestDataParallelDryRunAndRefusal(t *testing.T) {
	r := newRig(t, Policy{Kind: KindDataParallel, Min: 4, Max: 6, SLOS: 1}, true)
	r.f.setReplicas(1, 0)
	r.traffic(30, 2*time.Second)
	d := r.step()
	if len(d) != 1 || !d[0].DryRun || d[0].From != 4 || d[0].To != 5 || len(r.f.asked) != 0 || !strings.Contains(d[0].Detail, "(r0)") {
		t.Fatalf("a dry run from start 4: %+v %+v", d, r.f.asked)
	}
	r2 := newRig(t, Policy{Kind: KindDataParallel, Min: 4, Max: 6, SLOS: 1, CooldownS: 10}, false)
	r2.f.setReplicas(1, 0)
	r2.f.sizes["r0"] = 5 // the Host scaled it before
	r2.traffic(30, 2*time.Second)
	if d := r2.step(); len(d) != 1 || r2.f.asked[0].ID != "r0" || *r2.f.asked[0].DataParallelSize != 6 || r2.f.asked[0].Model != "" {
		t.Fatalf("data_parallel from the known size 5: %+v %+v", d, r2.f.asked)
	}
	r3 := newRig(t, Policy{Min: 1, Max: 2, SLOS: 1, CooldownS: 10}, false)
	r3.f.setReplicas(1, 0)
	r3.f.refuse = errdefs.New(errdefs.ErrConflict, "busy")
	r3.traffic(30, 2*time.Second)
	if d := r3.step(); len(d) != 1 || d[0].Error == "" || d[0].ScaleID != "" {
		t.Fatalf("a refused operation: %+v", d)
	}
	if d := r3.step(); len(d) != 0 {
		t.Fatalf("a refusal is not repeated every interval: %+v", d)
	}
}

func TestConfigCheck(t *testing.T) {
	for _, bad := range []struct {
		p    Policy
		want string
	}{
		{Policy{Min: 1, Max: 2}, "ttft_p95_slo_s is required"},
		{Policy{Min: 2, Max: 1, SLOS: 1}, "min ≤ max"},
		{Policy{Kind: "pods", Min: 1, Max: 1, SLOS: 1}, "want replicas or data_parallel"},
		{Policy{Min: 1, Max: 3, Start: 4, SLOS: 1}, "start 4 outside"},
		{Policy{Min: 1, Max: 3, SLOS: 1, ScaleInAt: 0.7, ScaleOutAt: 0.5}, "scale_in_at < scale_out_at"},
		{Policy{Min: 1, Max: 3, SLOS: 1, Instance: "x"}, "vllm_hi_id names the engine of a data_parallel"},
	} {
		err := Config{Models: map[string]Policy{"m": bad.p}}.Check()
		if err == nil || !strings.Contains(err.Error(), bad.want) || !strings.Contains(err.Error(), "autoscale.models.m") {
			t.Errorf("%+v: %v, want %q", bad.p, err, bad.want)
		}
	}
	if (Config{}).Enabled() {
		t.Fatal("an empty config is on")
	}
}

// The concurrency target scales out before anything waits, and holds a
// scale-in whose running requests would not fit on one replica fewer.
func TestConcurrencyTarget(t *testing.T) {
	r := newRig(t, Policy{Min: 1, Max: 3, SLOS: 1, RunningHigh: 10, CooldownS: 1}, false)
	r.f.setReplicas(2, 0)
	for i := range r.f.replicas {
		r.f.replicas[i].Stats.Running = 11
	}
	d := r.step()
	if len(d) != 1 || d[0].Reason != ReasonRunning || d[0].To != 3 || !strings.Contains(d[0].Detail, "22 requests running on 2") {
		t.Fatalf("11 running on each of 2 against 10: %+v", d)
	}
	r.f.end("scale-1", r.now)
	r.now = r.now.Add(2 * time.Second)
	r.f.setReplicas(3, 0)
	for i := range r.f.replicas {
		r.f.replicas[i].Stats.Running = 6 // 18 on 2 would be 9 each > 0.8 × 10
	}
	r.traffic(30, 10*time.Millisecond)
	if d := r.step(); len(d) != 0 {
		t.Fatalf("a scale-in that would not fit: %+v", d)
	}
	for i := range r.f.replicas {
		r.f.replicas[i].Stats.Running = 4 // 12 on 2: 6 each
	}
	if d := r.step(); len(d) != 1 || d[0].Direction != "in" || d[0].To != 2 {
		t.Fatalf("a scale-in that fits: %+v", d)
	}
}

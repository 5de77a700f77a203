package framework

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// paced runs the source at 15 ms a step: a data-plane fault acts on what
// the final round sends, so its case needs the source still writing when
// the migration pauses it; at 6 ms a step a starved machine let every
// stream reach its end (or its hold) before then.
var paced = Options{SourceStep: 15 * time.Millisecond}

// Cases are the migration tests every runner runs.
func Cases() []Case {
	cases := []Case{
		{Name: "destroy_source moves every stream exactly and releases the source", Run: destroySource},
		{Name: "preserve_source swaps the roles and keeps the source's KV", Run: preserveSource},
		{Name: "keep_source_active moves the longest 4", Run: keepSourceActive},
		{Name: "an expression filter moves the tagged streams", Run: exprFilter},
		{Name: "a target too small for every request's KV recomputes the rest", Options: Options{BBlocks: 70}, Run: scaleInOverflow},
		{Name: "a cut data connection rolls back", Options: paced, Run: rollsBack("cut")},
		{Name: "a frame that fails its checksum rolls back", Options: paced, Run: rollsBack("corrupt")},
		{Name: "silent corruption is caught before the commit", Options: paced, Run: silentCorruption},
		{Name: "refused requests change nothing", Run: refusals},
		{Name: "a drain moves every stream off A onto the active B and retires A", Options: Options{BActive: true}, Run: drainOnto},
	}
	// The seed's shape changes: scale out and in over TP and PP, and mixed.
	for _, sc := range [][2]Shape{
		{{TP: 1}, {TP: 2}}, {{TP: 2}, {TP: 1}}, {{PP: 1}, {PP: 2}}, {{PP: 2}, {PP: 1}},
		{{TP: 2}, {PP: 2}}, {{TP: 2, PP: 2}, {TP: 1}},
	} {
		cases = append(cases, Case{Name: fmt.Sprintf("%v → %v moves every stream exactly", sc[0], sc[1]),
			Options: Options{A: sc[0], B: sc[1]}, Run: shapeChange(sc[0], sc[1])})
	}
	return cases
}

// RDMACases are the cases a deployment whose agents move KV over the
// rdma data plane (UCX) runs: every stream exact, and the data-plane
// aborts rolling back as on tcp_shm.
func RDMACases() []Case {
	return []Case{
		{Name: "rdma: destroy_source moves every stream exactly", Run: overRDMA},
		{Name: "rdma: a cut data connection rolls back", Options: paced, Run: rollsBack("cut")},
		{Name: "rdma: a frame that fails its checksum rolls back", Options: paced, Run: rollsBack("corrupt")},
		{Name: "rdma: silent corruption is caught before the commit", Options: paced, Run: silentCorruption},
		{Name: "rdma: TP2 → TP1 moves every stream exactly", Options: Options{A: Shape{TP: 2}, B: Shape{TP: 1}}, Run: func(t *testing.T, c Cluster) {
			shapeChange(Shape{TP: 2}, Shape{TP: 1})(t, c)
		}},
	}
}

// overRDMA is destroySource where the agents were told to move KV over
// rdma: the status says so, and why.
func overRDMA(t *testing.T, c Cluster) {
	reqs := Load(32, 300)
	want := c.Reference(reqs)
	st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) || st.NewActiveInstance != c.B() {
		t.Fatalf("%+v", st)
	}
	if st.TransferBackend != "rdma" || !strings.Contains(st.TransferBackendReason, "UCX") {
		t.Fatalf("transfer backend %q (%q), want rdma", st.TransferBackend, st.TransferBackendReason)
	}
	for _, id := range []string{c.A(), c.B()} {
		if in := Instance(t, c, id); in.RDMA == nil || in.RDMA.UCXVersion == "" || len(in.RDMA.Transports) == 0 {
			t.Fatalf("instance %s does not report its rdma data plane: %+v (%s)", id, in.RDMA, in.RDMANote)
		}
	}
	HoldsNothing(t, c, c.B())
}

// shapeChange migrates A (shape a) → B (shape b) under load: the copy
// plan remaps heads and layers between the shapes; every stream stays
// exact and neither engine keeps a block once the streams end.
func shapeChange(a, b Shape) func(*testing.T, Cluster) {
	return func(t *testing.T, c Cluster) {
		for id, s := range map[string]Shape{c.A(): a, c.B(): b} {
			tp, pp := s.Sizes()
			if in := Instance(t, c, id); in.TP != tp || in.PP != pp {
				t.Fatalf("%s registered as TP%d×PP%d, want %v", id, in.TP, in.PP, s)
			}
		}
		tp, pp := b.Sizes()
		reqs := Load(16, 300)
		want := c.Reference(reqs)
		st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{Type: hostapi.PreserveSource, TargetTP: &tp, TargetPP: &pp})
		if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) || st.NewActiveInstance != c.B() {
			t.Fatalf("%+v", st)
		}
		HoldsNothing(t, c, c.B())
		HoldsNothing(t, c, c.A())
	}
}

func destroySource(t *testing.T, c Cluster) {
	reqs := Load(32, 300)
	want := c.Reference(reqs)
	st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) || st.NewActiveInstance != c.B() || st.DowntimeS <= 0 {
		t.Fatalf("%+v", st)
	}
	// Each agent reported its node's GPUs, or why it has none.
	if in := Instance(t, c, c.A()); len(in.GPUs) == 0 && in.GPUNote == "" {
		t.Fatalf("instance %s reports neither GPUs nor why there are none", in.ID)
	}
	// The status says which data plane moved the KV, and why.
	// (auto, unless the agents were told one: VLLM_HI_TRANSFER_BACKEND)
	if (st.TransferBackend != "tcp_shm" && st.TransferBackend != "cuda_ipc") ||
		!strings.HasPrefix(st.TransferBackendReason, "auto: ") && !strings.HasPrefix(st.TransferBackendReason, "asked for") {
		t.Fatalf("transfer backend %q (%q)", st.TransferBackend, st.TransferBackendReason)
	}
	Roles(t, c, "standby", "active")
	WaitFor(t, "the source's KV to be released", func() bool {
		s, _ := c.Host().Migration(context.Background(), st.ID)
		return s.SourceKV == hostapi.SourceKVReleased
	})
	if lc := Instance(t, c, c.A()).Lifecycle; lc != "retired" {
		t.Fatalf("the source is %s after destroy_source", lc)
	}
	Metrics(t, c, `vhi_migrations_total{state="succeeded"} 1`, "vhi_migration_downtime_seconds_count 1")
}

func preserveSource(t *testing.T, c Cluster) {
	reqs := Load(16, 300)
	want := c.Reference(reqs)
	st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{Type: hostapi.PreserveSource})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) || st.NewActiveInstance != c.B() || st.SourceKV != hostapi.SourceKVKept {
		t.Fatalf("%+v", st)
	}
	Roles(t, c, "standby", "active")
	if s, err := c.Engine(c.A()).Stats(context.Background()); err != nil || s.Sleeping {
		t.Fatalf("preserve_source must keep A's KV: %+v %v", s, err)
	}
	// And back: B → A, exact again.
	st = MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{Src: c.B(), Dst: c.A(), Type: hostapi.PreserveSource})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) {
		t.Fatalf("back: %+v", st)
	}
	Roles(t, c, "active", "standby")
}

func keepSourceActive(t *testing.T, c Cluster) {
	reqs := Load(16, 300)
	want := c.Reference(reqs)
	st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{Type: hostapi.KeepSourceActive, RequestFilter: "longest:4"})
	if st.State != hostapi.StateSucceeded || st.Migrated != 4 || st.NewActiveInstance != c.A() || st.RequestFilter != "longest:4" {
		t.Fatalf("%+v", st)
	}
	Roles(t, c, "active", "standby")
}

// A client tags its requests with the X-Vhi-Tag header; a CEL filter
// over the tag, the model and the token counts picks them. A bad
// expression is a 400 that says where it is wrong, and nothing starts.
func exprFilter(t *testing.T, c Cluster) {
	reqs := Load(16, 300)
	for i := range reqs {
		if i%4 == 1 {
			reqs[i].Header = http.Header{"X-Vhi-Tag": {"batch"}}
		}
	}
	want := c.Reference(reqs)
	_, err := c.Host().Migrate(context.Background(), hostapi.MigrateRequest{Src: c.A(), Dst: c.B(), RequestFilter: "expr:tag == batch"})
	if !hostapi.IsStatus(err, 400) || !strings.Contains(err.Error(), "1:8") {
		t.Fatalf("a bad expression: %v", err)
	}
	filter := fmt.Sprintf(`expr:tag == "batch" && model == %q && context_tokens > 0`, Model)
	st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{Type: hostapi.KeepSourceActive, RequestFilter: filter})
	if st.State != hostapi.StateSucceeded || st.Migrated != 4 || st.RequestFilter != filter {
		t.Fatalf("%+v", st)
	}
	Roles(t, c, "active", "standby")
}

// A target too small for every request's KV (a scale-in onto a smaller
// engine) takes what fits with its KV and the rest as state only, which
// it recomputes as blocks free: every stream exact, none stalls, and B
// holds nothing once they end.
func scaleInOverflow(t *testing.T, c Cluster) {
	reqs := Load(12, 200)
	want := c.Reference(reqs)
	st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{})
	if st.State != hostapi.StateSucceeded || st.Migrated != len(reqs) || len(st.Recomputed) == 0 || len(st.Recomputed) == len(reqs) {
		t.Fatalf("want some requests moved with their KV and some recomputed: %s, %d moved, recomputed %v (%s)",
			st.State, st.Migrated, st.Recomputed, st.Error)
	}
	Roles(t, c, "standby", "active")
	TargetHoldsNothing(t, c)
	Metrics(t, c, `vhi_migrations_total{state="succeeded"} 1`)
}

func rollsBack(fault string) func(*testing.T, Cluster) {
	return func(t *testing.T, c Cluster) {
		reqs := Load(32, 300)
		want := c.Reference(reqs)
		st := faultyMigration(t, c, reqs, want, fault)
		if st.State != hostapi.StateAborted || st.Committed || !strings.Contains(st.Error, "final copy round") {
			t.Fatalf("want a rollback in the final round, got %s at %s: %s (rounds %+v)", st.State, lastStep(st), st.Error, st.Rounds)
		}
		Roles(t, c, "active", "standby")
		TargetHoldsNothing(t, c)
		Metrics(t, c, `vhi_migrations_total{state="aborted"} 1`)
	}
}

// faultyMigration migrates with a data-plane fault in the final round. A
// fault acts on what the round sends: when the source wrote nothing
// since the last incremental round (a starved machine can stall it that
// long), there is nothing to damage and the migration rightly succeeds —
// keep_source_active leaves the roles as they were, and it is tried
// again.
func faultyMigration(t *testing.T, c Cluster, reqs []loadgen.Request, want []loadgen.Stream, fault string) hostapi.MigrationStatus {
	t.Helper()
	for attempt := 1; ; attempt++ {
		st := MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{Type: hostapi.KeepSourceActive, InjectFault: fault})
		if st.State != hostapi.StateSucceeded || finalBlocks(st) > 0 || attempt == 3 {
			return st
		}
		t.Logf("attempt %d: the final round had nothing to send, so nothing for %q to damage; again", attempt, fault)
		TargetHoldsNothing(t, c)
	}
}

// lastStep is the step a migration ended in (before done).
func lastStep(st hostapi.MigrationStatus) string {
	for i := len(st.StepHistory) - 1; i >= 0; i-- {
		if s := st.StepHistory[i].Step; s != "done" && s != "rollback" {
			return s
		}
	}
	return ""
}

func finalBlocks(st hostapi.MigrationStatus) int {
	for _, r := range st.Rounds {
		if r.Kind == "final" {
			return r.BlockCount
		}
	}
	return 0
}

// A copy that reports success with wrong bytes (a bug, bad memory) is
// caught by the check before the commit: the migration aborts and the
// streams go on from the source, exact.
func silentCorruption(t *testing.T, c Cluster) {
	reqs := Load(32, 300)
	want := c.Reference(reqs)
	st := faultyMigration(t, c, reqs, want, "silent_corrupt")
	if st.State != hostapi.StateAborted || !strings.Contains(st.Error, "integrity check failed") {
		t.Fatalf("a silently corrupted copy: %s at %s: %s (rounds %+v)", st.State, lastStep(st), st.Error, st.Rounds)
	}
	Metrics(t, c, "vhi_migration_integrity_failures_total 1", `vhi_migrations_total{state="aborted"} 1`)
	TargetHoldsNothing(t, c)
	// A clean migration checks the same blocks and passes.
	st = MigrateLoaded(t, c, reqs, want, hostapi.MigrateRequest{})
	if st.State != hostapi.StateSucceeded || st.Verification == nil || st.Verification.Mode != hostapi.VerifySample || st.Verification.Blocks < 2*st.Migrated {
		t.Fatalf("%+v (verification %+v)", st, st.Verification)
	}
}

// Requests the Host refuses get the contract's status and change nothing.
func refusals(t *testing.T, c Cluster) {
	a, b := c.A(), c.B()
	two := 2
	for _, r := range []struct {
		req    hostapi.MigrateRequest
		status int
	}{
		{hostapi.MigrateRequest{Src: a}, 400},
		{hostapi.MigrateRequest{Src: a, Dst: a}, 400},
		{hostapi.MigrateRequest{Src: "nope", Dst: b}, 404},
		{hostapi.MigrateRequest{Src: a, Dst: "nope"}, 404},
		{hostapi.MigrateRequest{Src: b, Dst: a}, 409},
		{hostapi.MigrateRequest{Src: a, Dst: b, Type: "teleport"}, 400},
		{hostapi.MigrateRequest{Src: a, Dst: b, RequestFilter: "shortest:3"}, 400},
		{hostapi.MigrateRequest{Src: a, Dst: b, TargetTP: &two}, 409},
		{hostapi.MigrateRequest{Src: a, Dst: b, TN: 1000}, 400},
	} {
		if _, err := c.Host().Migrate(context.Background(), r.req); !hostapi.IsStatus(err, r.status) {
			t.Errorf("%+v: %v, want %d", r.req, err, r.status)
		}
	}
	Roles(t, c, "active", "standby")
	if list, _ := c.Host().Migrations(context.Background()); len(list) != 0 {
		t.Fatalf("refusals were recorded as migrations: %d", len(list))
	}
	if _, err := c.Host().Migration(context.Background(), "mig-unknown"); !hostapi.IsStatus(err, 404) {
		t.Fatalf("an unknown migration: %v", err)
	}
}

// drainOnto drains A while A and B (both active) stream a load the Host
// spread over them: A's streams move to B by migration and go on from
// there exactly, A is retired, and new requests go to B alone. Bad drains
// before it change nothing.
func drainOnto(t *testing.T, c Cluster) {
	ctx := context.Background()
	a, b := c.A(), c.B()
	Roles(t, c, "active", "active")
	for _, r := range []struct {
		id     string
		req    hostapi.DrainRequest
		status int
	}{
		{"nope", hostapi.DrainRequest{}, 404},
		{a, hostapi.DrainRequest{To: []string{"nope"}}, 404},
		{a, hostapi.DrainRequest{To: []string{a}}, 409},
	} {
		if _, err := c.Host().Drain(ctx, r.id, r.req); !hostapi.IsStatus(err, r.status) {
			t.Errorf("drain %s %+v: %v, want %d", r.id, r.req, err, r.status)
		}
	}
	if lc := Instance(t, c, a).Lifecycle; lc != "active" {
		t.Fatalf("a refused drain left A %s", lc)
	}
	reqs := Load(24, 300)
	want := c.Reference(reqs)
	// A's streams stay there until the drain has moved them (HoldStreams):
	// "moved" is asserted, not left to the machine's speed.
	release := HoldStreams(t, c, a)
	running := make(chan []loadgen.Stream, 1)
	go func() {
		running <- loadgen.Run(ctx, loadgen.Config{BaseURL: c.HostURL(), Model: Model}, reqs)
	}()
	WaitFor(t, "the load to run on A and B", func() bool {
		sa, err1 := c.Engine(a).Stats(ctx)
		sb, err2 := c.Engine(b).Stats(ctx)
		return err1 == nil && err2 == nil && sa.NumRunning > 0 && sb.NumRunning > 0 && sa.NumRunning+sb.NumRunning >= len(reqs)
	})
	onA, _ := c.Engine(a).Stats(ctx)
	wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	id, err := c.Host().Drain(wctx, a, hostapi.DrainRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Host().Drain(wctx, a, hostapi.DrainRequest{}); !hostapi.IsStatus(err, 409) {
		t.Errorf("a second drain of A: %v, want 409", err)
	}
	st, err := c.Host().WaitDrain(wctx, id, 20*time.Millisecond, nil)
	release()
	if err != nil {
		t.Fatal(err)
	}
	CheckExact(t, <-running, want)
	if st.State != hostapi.StateSucceeded || st.Remaining != 0 || st.Moved == 0 || st.Moved+st.Finished < onA.NumRunning ||
		len(st.Migration) == 0 || len(st.Targets) != 1 || st.Targets[0] != b {
		t.Fatalf("drain %+v (A ran %d)", st, onA.NumRunning)
	}
	t.Logf("drain: %d moved, %d finished on A, %d migrations", st.Moved, st.Finished, len(st.Migration))
	for _, mid := range st.Migration {
		m, err := c.Host().Migration(ctx, mid)
		if err != nil || m.Type != hostapi.KeepSourceActive || m.Dst != b {
			t.Fatalf("drain migration %s: %+v %v", mid, m, err)
		}
	}
	if in := Instance(t, c, a); in.Lifecycle != "retired" {
		t.Fatalf("A is %s after its drain", in.Lifecycle)
	}
	if in := Instance(t, c, b); in.Lifecycle != "active" {
		t.Fatalf("B is %s after the drain", in.Lifecycle)
	}
	// New requests go to B alone.
	more := Load(4, 20)
	CheckExact(t, loadgen.Run(ctx, loadgen.Config{BaseURL: c.HostURL(), Model: Model}, more), c.Reference(more))
	HoldsNothing(t, c, b)
	if list, err := c.Host().Drains(ctx); err != nil || len(list) != 1 || list[0].ID != id {
		t.Fatalf("drains: %+v %v", list, err)
	}
	Metrics(t, c, `vhi_drains_total{state="succeeded"} 1`, `vhi_drains_total{state="refused"} 4`)
}

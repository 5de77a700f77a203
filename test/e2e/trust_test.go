package e2e

import (
	"context"
	"encoding/json"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
	"github.com/vllm-hi/vllm-hi/test/framework"
)

// The tests of this file reproduce what probing vllm-hi as an attacker and
// as a careful operator found, each against real processes.

// migrateLoaded streams reqs through the Host, migrates after the load
// started, and checks every stream against want.
func (d *deployment) migrateLoaded(t *testing.T, reqs []loadgen.Request, want []loadgen.Stream, req hostapi.MigrateRequest) hostapi.MigrationStatus {
	t.Helper()
	release := framework.HoldStreams(t, d, req.Src)
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	st := d.waitMigration(t, req)
	release()
	checkExact(t, <-running, want)
	return st
}

// waitSourceKV waits for a destroy_source migration's source to report
// what became of its KV.
func (d *deployment) waitSourceKV(t *testing.T, id, want string) {
	t.Helper()
	var st hostapi.MigrationStatus
	waitUntil(t, "the source's KV "+want, func() bool { st = d.status(t, id); return st.SourceKV == want })
}

func (d *deployment) wake(t *testing.T, id string) {
	t.Helper()
	out, err := exec.Command(vhiBin, "wake", id, "--host", d.hostURL, "--admin-token-file", d.tk.adminFile).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "standby") {
		t.Fatalf("vhi wake %s: %v\n%s", id, err, out)
	}
	// A heartbeat the agent sent before the wake can still land after it
	// and list the engine asleep until the next one: a clean-clone run's
	// next migration onto it was refused (409, "target is sleeping"). The
	// registry taking such a stale heartbeat is the Host's to fix; the
	// test waits it out.
	waitUntil(t, id+" listed awake", func() bool { return instance(t, d.hostURL, id).Lifecycle == "standby" })
}

// An engine that sleeps and wakes re-creates its KV under the same path;
// an agent that kept mapping the old, unlinked memory moved streams to
// wrong continuations. Three migrations back and forth, each engine woken
// in between, stay exact in both directions.
func TestEnginesWokenAfterRetirementMigrateExactly(t *testing.T) {
	d := deploy(t, 4096)
	reqs := load(16, 300)
	want := d.reference(reqs)
	for i, mv := range [][2]string{{"A", "B"}, {"B", "A"}, {"A", "B"}} {
		st := d.migrateLoaded(t, reqs, want, hostapi.MigrateRequest{Src: mv[0], Dst: mv[1]})
		if st.State != "succeeded" || st.Migrated != 16 {
			t.Fatalf("migration %d %s→%s: %+v", i, mv[0], mv[1], st)
		}
		d.waitSourceKV(t, st.ID, "released")
		if lc := instance(t, d.hostURL, mv[0]).Lifecycle; lc != "retired" {
			t.Fatalf("%s after destroy_source: %s", mv[0], lc)
		}
		d.wake(t, mv[0])
	}
}

// The agents' gRPC, the engines' hooks, the data plane and the registry
// all refuse callers without the right credential.
func TestEveryPlaneRefusesStrangers(t *testing.T) {
	d := deploy(t, 4096)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	// Engine hooks and control routes.
	for _, c := range []struct{ method, path string }{{"GET", "/vllm_hi/engine/requests"}, {"POST", "/vllm_hi/engine/abort"}, {"POST", "/sleep"}} {
		req, _ := http.NewRequest(c.method, d.aURL+c.path, strings.NewReader("{}"))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s %s without the agent token: %d", c.method, c.path, resp.StatusCode)
		}
	}
	if !instance(t, d.hostURL, "A").HooksAuthenticated {
		t.Error("the Host does not show A's hooks as authenticated")
	}

	// An agent's gRPC service: no token, or the admin's, is refused.
	a := instance(t, d.hostURL, "A")
	conn, err := grpc.NewClient(a.AgentAddress, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	agent := v1.NewAgentClient(conn)
	for _, tok := range []string{"", d.tk.admin} {
		cctx := ctx
		if tok != "" {
			cctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
		}
		if _, err := agent.Hook(cctx, &v1.HookRequest{Name: "requests"}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("Hook with token %q: %v", tok, err)
		}
		if _, err := agent.CopyRound(cctx, &v1.CopyRoundRequest{MigrationId: "x", TargetDataAddress: "127.0.0.1:1"}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("CopyRound with token %q: %v", tok, err)
		}
	}

	// The registry: a fake engine with the admin token is refused; an
	// agent without any token exits with a clear message.
	hc, err := grpc.NewClient(d.hostAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	_, err = v1.NewRegistryClient(hc).Register(metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+d.tk.admin),
		&v1.RegisterRequest{VllmHiId: "fake", Type: v1.InstanceType_INSTANCE_TYPE_A, Session: "s",
			Engine: &v1.EngineInfo{EngineUrl: "http://127.0.0.1:1", ServedModelNames: []string{"m"}, Tp: 1, Pp: 1}})
	if status.Code(err) != codes.Unauthenticated {
		t.Errorf("a registration with the admin token: %v", err)
	}
	cmd := exec.Command(vhiBin, "agent", "--type", "A", "--id", "intruder", "--host", d.hostAddr, "--engine", d.aURL, "--engine-wait", "5s")
	cmd.Env = append(os.Environ(), "XDG_STATE_HOME="+t.TempDir()) // no local Host's token to find
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "--token-file") {
		t.Errorf("an agent without a token: %v\n%s", err, out)
	}

	// The data plane: during a migration, whose id and target address
	// anyone can read from the Host, a stranger cannot write a byte.
	reqs := load(32, 400)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	id := d.startMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	b := instance(t, d.hostURL, "B")
	_, err = tcpshm.Send(ctx, tcpshm.Dest{Addr: b.DataAddress, Session: id, Secret: []byte("guessed, not handed out by the Host")}, 1,
		[][]byte{make([]byte, 64)}, []kvlayout.CopyRun{{Length: 64}}, transfer.NoFault)
	if err == nil {
		t.Fatal("a stranger wrote into the target's KV")
	}
	if st := d.waitEnd(t, id); st.State != "succeeded" {
		t.Fatalf("the migration: %+v", st)
	}
	checkExact(t, <-running, want)
}

// A target agent that stops answering mid-migration (SIGSTOP: a stalled
// process, a network partition) cannot hold the migration: it aborts at
// its deadline, the source never stops serving, and nothing is reported
// as moved. Before, such a migration held both instances for minutes and
// then reported "succeeded" with nothing moved.
func TestStalledTargetAbortsAtItsDeadline(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--migration-reservation-lease", "4s", "--migration-rpc-timeout", "2s"}})
	reqs := load(32, 400)
	want := d.reference(reqs)
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	id := d.startMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	stopped := time.Now()
	pid := d.agentB.cmd.Process.Pid
	_ = syscall.Kill(pid, syscall.SIGSTOP)
	defer func() { _ = syscall.Kill(pid, syscall.SIGCONT) }()
	st := d.waitEnd(t, id)
	took := time.Since(stopped)
	if st.State != "aborted" || st.Migrated != 0 {
		t.Fatalf("a migration to a stalled target: %+v", st)
	}
	if took > 10*time.Second {
		t.Fatalf("the abort took %v (the reservation lease is 4 s)", took)
	}
	checkExact(t, <-running, want)
	if roleOf(t, d.hostURL, "A") != "active" {
		t.Fatal("A lost its role")
	}
	_ = syscall.Kill(pid, syscall.SIGCONT)
	waitUntil(t, "B's reservations gone", func() bool { s := d.stats(t, d.bURL); return s.Reserved == 0 && s.Free == s.Total })
}

// Requests that reach the source just before a destroy_source switch —
// waiting in its queue, not yet running, so they do not move — finish on
// the source before it releases its KV. Before, retiring the source
// aborted them: HTTP 200, finish_reason "abort", no tokens.
func TestRequestsWaitingOnTheSourceFinishThere(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, simArgs: []string{"--max-num-seqs", "8"}})
	reqs := load(24, 300)
	want := d.reference(reqs)
	st := d.migrateLoaded(t, reqs, want, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	if st.State != "succeeded" || st.Migrated == 0 || st.Migrated > 8 {
		t.Fatalf("%+v", st)
	}
	d.waitSourceKV(t, st.ID, "released")
}

// Clients that send the same X-Request-Id (or one with '/' and '?') get
// streams of their own: the Host names engine requests itself, so every
// stream moves.
func TestClientRequestIDsAreNotTrusted(t *testing.T) {
	d := deploy(t, 4096)
	reqs := load(8, 300)
	want := d.reference(reqs)
	release := framework.HoldStreams(t, d, "A")
	running := make(chan []loadgen.Stream, 1)
	go func() {
		running <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.hostURL, Model: "m",
			Header: http.Header{"X-Request-Id": {"same/for?all"}}}, reqs)
	}()
	time.Sleep(900 * time.Millisecond)
	st := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	release()
	checkExact(t, <-running, want)
	if st.State != "succeeded" || st.Migrated != 8 {
		t.Fatalf("%+v", st)
	}
}

// Roles, lifecycle and migration records survive a Host killed by
// SIGKILL, and agents killed and restarted with their start-up types get
// their instance's role back.
func TestRestartsKeepRoles(t *testing.T) {
	d := deploy(t, 4096)
	reqs := load(8, 200)
	want := d.reference(reqs)
	st := d.migrateLoaded(t, reqs, want, hostapi.MigrateRequest{Src: "A", Dst: "B"})
	if st.State != "succeeded" {
		t.Fatalf("%+v", st)
	}
	d.waitSourceKV(t, st.ID, "released")
	served := func(what string) {
		t.Helper()
		got := loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.hostURL, Model: "m"}, reqs[:2])
		if got[0].Err != nil || got[0].Text != want[0].Text {
			t.Fatalf("after %s: %v", what, got[0].Err)
		}
	}
	check := func(what string) {
		t.Helper()
		waitUntil(t, "both agents back after "+what, func() bool {
			a, b := instance(t, d.hostURL, "A"), instance(t, d.hostURL, "B")
			return a.State != "unreachable" && b.State != "unreachable" && a.ID != "" && b.ID != ""
		})
		a, b := instance(t, d.hostURL, "A"), instance(t, d.hostURL, "B")
		if b.Role != "active" || a.Role != "standby" || a.Lifecycle != "retired" {
			t.Fatalf("after %s: A %s/%s, B %s/%s", what, a.Role, a.Lifecycle, b.Role, b.Lifecycle)
		}
		served(what)
	}
	d.host.kill()
	d.host = d.startHost(t)
	check("a Host killed by SIGKILL")
	if got := d.status(t, st.ID); got.State != "succeeded" {
		t.Fatalf("the migration record after the Host restart: %+v", got)
	}
	d.agentB.kill()
	d.agentB = d.startAgent(t, "B", "B", d.bURL)
	d.agentA.kill()
	d.agentA = d.startAgent(t, "A", "A", d.aURL)
	check("both agents killed by SIGKILL and restarted")
}

// A hung engine answers 504 (no answer within --upstream-timeout) or, once
// its agent reports it unhealthy, 503 with Retry-After; a stream whose
// engine goes silent ends with an error event; a dead engine gets no more
// traffic (503, not 502).
func TestHungAndDeadEngines(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, hostArgs: []string{"--upstream-timeout", "2s", "--stream-idle-timeout", "2s"}})
	streaming := make(chan []loadgen.Stream, 1)
	go func() {
		streaming <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.hostURL, Model: "m"}, load(1, 900))
	}()
	time.Sleep(500 * time.Millisecond)
	pid := d.simA.cmd.Process.Pid
	_ = syscall.Kill(pid, syscall.SIGSTOP)
	defer func() { _ = syscall.Kill(pid, syscall.SIGCONT) }()
	select {
	case got := <-streaming:
		if got[0].Err == nil || !strings.Contains(got[0].Err.Error(), "sent nothing") {
			t.Fatalf("a stream whose engine hung: %v", got[0].Err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a stream whose engine hung was not ended")
	}
	start := time.Now()
	resp, err := http.Post(d.hostURL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if (resp.StatusCode != 504 && resp.StatusCode != 503) || time.Since(start) > 5*time.Second {
		t.Fatalf("a request to a hung engine: %d after %v", resp.StatusCode, time.Since(start))
	}
	_ = syscall.Kill(pid, syscall.SIGCONT)
	d.simA.kill()
	waitUntil(t, "the dead engine out of routing", func() bool {
		resp, err := http.Post(d.hostURL+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"x","max_tokens":2}`))
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 503 && resp.Header.Get("Retry-After") != ""
	})
	if lc := instance(t, d.hostURL, "A").Lifecycle; lc != "unhealthy" {
		t.Fatalf("a dead engine is %s", lc)
	}
}

// Under -o json the CLI answers errors as the contract's error object on
// stdout, with a non-zero exit.
func TestCLIErrorsAsJSON(t *testing.T) {
	d := deploy(t, 4096)
	for _, args := range [][]string{
		{"instances", "--host", "http://127.0.0.1:1", "-o", "json"},
		{"migrate", "--host", d.hostURL, "--src", "B", "--dst", "A", "-o", "json", "--admin-token-file", d.tk.adminFile},
		{"migration", "status", "mig-nope", "--host", d.hostURL, "-o", "json"},
	} {
		cmd := exec.Command(vhiBin, args...)
		out, err := cmd.Output()
		var e struct {
			Error struct {
				Message string `json:"message"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		if err == nil || json.Unmarshal(out, &e) != nil || e.Error.Message == "" {
			t.Errorf("vhi %v: %v, stdout %q", args, err, out)
		}
	}
}

package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/test/framework"

	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// deployment is Host + sim A + sim B + two agents as processes, plus a
// lone reference sim for unmigrated runs. Every plane is authenticated,
// as it is by default.
type deployment struct {
	hostURL, aURL, bURL, refURL string
	hostAddr, dataDir, shm      string
	host, agentA, agentB        *proc
	simA, simB                  *proc
	simArgs                     [2][]string // sims A and B's command lines, for restarts
	agentArgs                   [2][]string // agents A and B's extra flags
	moreHosts                   []string    // Hosts the agents name after hostAddr
	tk                          tokens
	hostArgs                    []string
	client                      *hostapi.Client // with the admin token (the framework's runner sets it)
}

// deployOptions vary a deployment.
type deployOptions struct {
	bBlocks  int
	simArgs  []string // extra flags of sims A and B
	aArgs    []string // extra flags of sim A only
	bArgs    []string // extra flags of sim B only
	refArgs  []string // extra flags of the reference sim
	hostArgs []string // extra flags of the Host
	bActive  bool     // B's agent registers type A (active beside A)
	// aRanks, bRanks: A's and B's TP × PP (0: 1), for VHI_E2E_SIM_RANK_GPUS.
	aRanks, bRanks int
	// kvScale: every sim's --kv-scale, the reference's too (0: the
	// sim's default); smaller moves more bytes per token.
	kvScale int
	// agentArgs: extra flags of agents A and B.
	agentArgs [2][]string
	// moreHosts: further Hosts' addresses the agents name after the
	// deployment's own (Hosts sharing a store; the test starts them).
	moreHosts []string
}

func deploy(t *testing.T, bBlocks int) *deployment {
	return deployWith(t, deployOptions{bBlocks: bBlocks})
}

func deployWith(t *testing.T, o deployOptions) *deployment {
	t.Helper()
	shm := t.TempDir()
	d := &deployment{tk: newTokens(t), dataDir: t.TempDir(), shm: shm, agentArgs: o.agentArgs, moreHosts: o.moreHosts}
	bBlocks := o.bBlocks
	// VHI_E2E_SIM_DEVICES=cuda:0,cuda:1,cuda:0 puts the KV of A, B and the
	// reference on GPUs (the GPU machines run these tests that way; the
	// migration then goes through cuda_ipc).
	devices := []string{"cpu", "cpu", "cpu"}
	if v := os.Getenv("VHI_E2E_SIM_DEVICES"); v != "" {
		devices = strings.Split(v, ",")
		if len(devices) != 3 {
			t.Fatalf("VHI_E2E_SIM_DEVICES=%q: want three devices (A, B, reference)", v)
		}
	}
	// VHI_E2E_SIM_RANK_GPUS=cuda:0,cuda:1 spreads the ranks of a sim A or
	// B of more than one rank over those GPUs (rank i on GPU i mod 2), as
	// vLLM places its workers: a reshape then moves KV across GPUs.
	if v := os.Getenv("VHI_E2E_SIM_RANK_GPUS"); v != "" {
		pool := strings.Split(v, ",")
		for i, n := range []int{o.aRanks, o.bRanks} {
			if n > 1 {
				ranks := make([]string, n)
				for r := range ranks {
					ranks[r] = pool[r%len(pool)]
				}
				devices[i] = strings.Join(ranks, ",")
			}
		}
	}
	simArgs := func(port int, blocks int, device string) []string {
		args := []string{"sim", "--port", fmt.Sprint(port), "--served-model-name", "m", "--shm-dir", shm,
			"--num-gpu-blocks", fmt.Sprint(blocks), "--max-model-len", "1024", "--step-fixed", "6ms", "--log-level", "warn",
			"--device", device, "--engine-token-file", d.tk.agentFile}
		if strings.Contains(strings.Join(devices, ","), "cuda") {
			// GPU copies move 16-byte multiples; every engine of a
			// deployment shares one geometry.
			args = append(args, "--kv-scale", "8")
		}
		if o.kvScale > 0 {
			args = append(args, "--kv-scale", fmt.Sprint(o.kvScale))
		}
		return args
	}
	var urls []string
	var sims []*proc
	for i, blocks := range []int{4096, bBlocks, 4096} {
		port := freePort(t)
		args := simArgs(port, blocks, devices[i])
		if i < 2 {
			args = append(args, o.simArgs...)
		}
		switch i {
		case 0:
			args = append(args, o.aArgs...)
		case 1:
			args = append(args, o.bArgs...)
		case 2:
			args = append(args, o.refArgs...)
		}
		if i < 2 {
			d.simArgs[i] = args
		}
		sims = append(sims, startVHI(t, args...))
		u := fmt.Sprintf("http://127.0.0.1:%d", port)
		waitHealthy(t, u+"/health")
		urls = append(urls, u)
	}
	d.aURL, d.bURL, d.refURL = urls[0], urls[1], urls[2]
	d.simA, d.simB = sims[0], sims[1]
	d.hostAddr = fmt.Sprintf("127.0.0.1:%d", freePort(t))
	d.hostURL = "http://" + d.hostAddr
	d.hostArgs = append(append([]string{"host", "--listen", d.hostAddr, "--heartbeat-interval", "500ms", "--allow-fault-injection",
		"--migration-pause-lease", "2s", "--migration-reservation-lease", "10s", "--log-level", "warn", "--data-dir", d.dataDir},
		d.tk.hostArgs()...), o.hostArgs...)
	d.host = d.startHost(t)
	d.agentA = d.startAgent(t, "A", "A", d.aURL)
	bType := "B"
	if o.bActive {
		bType = "A"
	}
	d.agentB = d.startAgent(t, "B", bType, d.bURL)
	deadline := time.Now().Add(20 * time.Second)
	for len(listInstances(t, d.hostURL)) != 2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if len(listInstances(t, d.hostURL)) != 2 {
		t.Fatalf("the agents did not both register; agent A:\n%s\nagent B:\n%s\nsim A:\n%s\nsim B:\n%s",
			d.agentA.stderr, d.agentB.stderr, d.simA.stderr, d.simB.stderr)
	}
	return d
}

// startHost (re)starts the deployment's Host.
func (d *deployment) startHost(t *testing.T) *proc {
	t.Helper()
	p := startVHI(t, d.hostArgs...)
	waitHealthy(t, d.hostURL+"/health")
	return p
}

// startAgent starts agent id of type typ ("A" or "B") beside engine.
func (d *deployment) startAgent(t *testing.T, id, typ, engine string) *proc {
	t.Helper()
	hosts := strings.Join(append([]string{d.hostAddr}, d.moreHosts...), ",")
	args := []string{"agent", "--type", typ, "--id", id, "--host", hosts, "--engine", engine, "--log-level", "warn",
		"--token-file", d.tk.agentFile}
	switch id {
	case "A":
		args = append(args, d.agentArgs[0]...)
	case "B":
		args = append(args, d.agentArgs[1]...)
	}
	return startVHI(t, args...)
}

func load(n, tokens int) []loadgen.Request { return framework.Load(n, tokens) }

// startLoad streams reqs through the Host in the background.
func (d *deployment) startLoad(reqs []loadgen.Request) <-chan []loadgen.Stream {
	ch := make(chan []loadgen.Stream, 1)
	url := d.hostURL // a test may point d at another Host meanwhile
	go func() { ch <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: url, Model: "m"}, reqs) }()
	return ch
}

// migrateUnderLoad streams reqs through the Host with A holding them
// (framework.HoldStreams), and once A runs every one (and settle more)
// runs the migration asked: its status, the streams as they ended and
// their unmigrated run.
func (d *deployment) migrateUnderLoad(t *testing.T, reqs []loadgen.Request, settle time.Duration, req hostapi.MigrateRequest) (st hostapi.MigrationStatus, got, want []loadgen.Stream) {
	t.Helper()
	want = d.reference(reqs)
	release := framework.HoldStreams(t, d, "A")
	running := d.startLoad(reqs)
	waitUntil(t, "A to run every stream", func() bool { return d.stats(t, d.aURL).Running == len(reqs) })
	time.Sleep(settle)
	st = d.waitMigration(t, req)
	release()
	return st, <-running, want
}

func checkExact(t *testing.T, got, want []loadgen.Stream) {
	t.Helper()
	framework.CheckExact(t, got, want)
}

func (d *deployment) migrate(t *testing.T, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, d.hostURL+"/vllm_hi/migrate", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+d.tk.admin)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	_, _ = b.ReadFrom(resp.Body)
	return resp.StatusCode, b.String()
}

// startMigration starts a migration that must be accepted and returns its
// id.
func (d *deployment) startMigration(t *testing.T, req hostapi.MigrateRequest) string {
	t.Helper()
	id, err := hostClient(t, d.hostURL, d.tk.admin).Migrate(context.Background(), req)
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return id
}

func (d *deployment) waitMigration(t *testing.T, req hostapi.MigrateRequest) hostapi.MigrationStatus {
	t.Helper()
	return d.waitEnd(t, d.startMigration(t, req))
}

// waitEnd polls a migration until it ends.
func (d *deployment) waitEnd(t *testing.T, id string) hostapi.MigrationStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	st, err := hostClient(t, d.hostURL, "").WaitMigration(ctx, id, 50*time.Millisecond, nil)
	if err != nil {
		t.Fatalf("waiting for migration %s: %v", id, err)
	}
	return st
}

// status reads a migration's status (zero while the Host cannot be
// reached: callers wait for a condition).
func (d *deployment) status(t *testing.T, id string) hostapi.MigrationStatus {
	t.Helper()
	st, _ := hostClient(t, d.hostURL, "").Migration(context.Background(), id)
	return st
}

type engineStats struct {
	Free, Total, Reserved, Running int
}

func (d *deployment) stats(t *testing.T, url string) engineStats {
	t.Helper()
	var s struct {
		Free     int `json:"free_blocks"`
		Total    int `json:"total_blocks"`
		Reserved int `json:"reserved_blocks"`
		Running  int `json:"num_running"`
	}
	resp, err := authGet(url+"/vllm_hi/engine/stats", d.tk.agent)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	_ = json.NewDecoder(resp.Body).Decode(&s)
	return engineStats{s.Free, s.Total, s.Reserved, s.Running}
}

func (d *deployment) reference(reqs []loadgen.Request) []loadgen.Stream { return d.Reference(reqs) }

func roleOf(t *testing.T, hostURL, id string) string {
	return instance(t, hostURL, id).Role
}

// 64 streams move from A to B mid-stream through `vhi migrate --wait`:
// every stream equals its unmigrated run, one [DONE], correct usage; then
// destroy_source has made B active and released A's KV.
func TestMigrationEveryStreamExact(t *testing.T) {
	d := deploy(t, 4096)
	reqs := load(64, 400)
	want := d.reference(reqs)
	release := framework.HoldStreams(t, d, "A") // every stream there to move, on any machine
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	out, err := exec.Command(vhiBin, "migrate", "--host", d.hostURL, "--src", "A", "--dst", "B", "--wait", "--admin-token-file", d.tk.adminFile).CombinedOutput()
	release()
	if err != nil {
		t.Fatalf("vhi migrate --wait: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "succeeded") || !strings.Contains(string(out), "final") || !strings.Contains(string(out), " 64/64 ") {
		t.Fatalf("not every stream moved:\n%s", out)
	}
	checkExact(t, <-running, want)
	if roleOf(t, d.hostURL, "B") != "active" || roleOf(t, d.hostURL, "A") != "standby" {
		t.Fatalf("roles after destroy_source: %+v", listInstances(t, d.hostURL))
	}
	hostMetrics(t, d.hostURL, `vhi_migrations_total{state="succeeded"} 1`, "vhi_migration_downtime_seconds_count 1",
		"vhi_migration_client_downtime_seconds_count 1", "vhi_migrated_requests_total 64")
	if os.Getenv("VLLM_HI_RELAY_EVENT_LOOP") == "true" {
		// The Host relayed on its event loop (make test runs this so), and
		// every moved stream left it for the goroutine relay's switch.
		hostMetrics(t, d.hostURL, `vhi_proxy_event_loop_streams_total{outcome="handed_back"} 64`)
	}
	waitUntil(t, "A's KV released", func() bool {
		resp, err := http.Get(d.aURL + "/is_sleeping")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		var v struct {
			S bool `json:"is_sleeping"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&v)
		return v.S
	})
	if s := d.stats(t, d.bURL); s.Free != s.Total || s.Reserved != 0 {
		t.Fatalf("B leaked blocks: %+v", s)
	}
	// New requests go to B now.
	if got := loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.hostURL, Model: "m"}, reqs[:2]); got[0].Err != nil || got[0].Text != want[0].Text {
		t.Fatalf("after the migration: %+v", got[0].Err)
	}
	if out, err := exec.Command(vhiBin, "migration", "status", "nope", "--host", d.hostURL).CombinedOutput(); err == nil {
		t.Fatalf("status of an unknown migration exited 0: %s", out)
	}
}

func TestMigrationBadInput(t *testing.T) {
	d := deploy(t, 4096)
	for _, c := range []struct {
		body string
		code int
	}{
		{`{"src_vllm_hi_id":`, 400},
		{`{"src_vllm_hi_id":"A"}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"A"}`, 400},
		{`{"src_vllm_hi_id":"nope","dst_vllm_hi_id":"B"}`, 404},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"nope"}`, 404},
		{`{"src_vllm_hi_id":"B","dst_vllm_hi_id":"A"}`, 409},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","migration_type":"teleport"}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","request_filter":"shortest:3"}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","target_tp":2}`, 409},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","tn":1000}`, 400},
		// A typo must not fall back to the default (destroy_source).
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","migration_typ":"preserve_source"}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B"}{"src_vllm_hi_id":"B"}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B"} trailing`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","target_gpu_memory_utilization":-0.5}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","target_gpu_memory_utilization":1.5}`, 400},
		{`{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","target_tp":0}`, 400},
	} {
		code, body := d.migrate(t, c.body)
		if code != c.code || !strings.Contains(body, fmt.Sprintf(`"code":%d`, c.code)) {
			t.Errorf("%s: %d %s, want %d", c.body, code, body, c.code)
		}
	}
	if roleOf(t, d.hostURL, "A") != "active" || roleOf(t, d.hostURL, "B") != "standby" || len(listMigrations(t, d.hostURL)) != 0 {
		t.Fatal("a refused migrate request changed something")
	}
	if _, err := hostClient(t, d.hostURL, "").Migration(context.Background(), "mig-unknown"); !hostapi.IsStatus(err, 404) {
		t.Fatalf("unknown migration: %v", err)
	}
	// Busy: a second migration of the same pair while the first runs.
	reqs := load(32, 150)
	running := d.startLoad(reqs)
	time.Sleep(300 * time.Millisecond)
	code, body := d.migrate(t, `{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B"}`)
	if code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	if code, body := d.migrate(t, `{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B"}`); code != 409 {
		t.Fatalf("second migration: %d %s", code, body)
	}
	for _, s := range <-running {
		if s.Err != nil {
			t.Fatal(s.Err)
		}
	}
}

// B's agent dies after it reserved its blocks and accepted the
// migration, before anything is installed (not after round 0: on GPUs
// the whole migration can end before a poll sees that round). The
// migration aborts, A resumes, and every stream goes on from A exactly;
// the rollback frees B's blocks through B's engine. (The other faults before the
// commit are test/framework's cases and internal/migrate's.)
func TestTargetAgentDiesMidMigration(t *testing.T) { targetAgentDies(t) }

func targetAgentDies(t *testing.T) {
	d := deploy(t, 4096)
	reqs := load(32, 400)
	want := d.reference(reqs)
	b0 := d.stats(t, d.bURL)
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	id := d.startMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", TN: 1})
	d.agentB.kill()
	died := time.Now()
	st := d.waitEnd(t, id)
	if st.State != "aborted" || st.Error == "" {
		t.Fatalf("want aborted, got %+v", st)
	}
	// B's reservations go with the rollback, through B's engine itself,
	// not with B's reservation lease (10 s here; issue 44: 45 s before).
	waitUntil(t, "B's reservations released", func() bool { return d.stats(t, d.bURL).Reserved == 0 })
	freed := time.Since(died)
	if freed > 5*time.Second {
		t.Fatalf("B's reservations were released %v after its agent died: its lease freed them, not the rollback", freed)
	}
	t.Logf("B's reservations released %v after its agent died (the abort reported %v after it; the lease: 10 s)",
		freed.Round(time.Millisecond), st.FinishedAt.Sub(died).Round(time.Millisecond))
	checkExact(t, <-running, want)
	if roleOf(t, d.hostURL, "A") != "active" {
		t.Fatal("A lost its role after an aborted migration")
	}
	hostMetrics(t, d.hostURL, `vhi_migrations_total{state="aborted"} 1`, "vhi_migration_downtime_seconds_count 0")
	waitUntil(t, "no leaked blocks", func() bool {
		a, b := d.stats(t, d.aURL), d.stats(t, d.bURL)
		return a.Free == a.Total && b.Free == b0.Free && b.Reserved == 0
	})
	if !strings.Contains(d.host.stderr.String(), "released the target's reservations through its engine directly") {
		t.Fatalf("the rollback did not release B's reservations directly; the Host's log:\n%s", grepLines(d.host.stderr.String(), "WARN"))
	}
}

// The Host dies while A is paused: A resumes by itself when its pause
// lease ends, and the Host, restarted on its data directory, releases B's
// reservations at once from its record of the migration — not when their
// lease (10 s here) ends (issue 44: 51 s of 986 blocks held before).
func TestHostDiesWhileSourcePaused(t *testing.T) {
	d := deploy(t, 4096)
	direct, viaHost := d.hostDiesInThePause(t)
	died := time.Now()
	if b := d.stats(t, d.bURL); b.Reserved == 0 {
		t.Fatalf("B holds no reservation when the Host died: %+v", b)
	}
	restarted := time.Now()
	d.host = d.startHost(t)
	waitUntil(t, "B's reservations released", func() bool { return d.stats(t, d.bURL).Reserved == 0 })
	freed := time.Since(restarted)
	// Generous for a loaded 2-core machine; the reservation lease is 10 s.
	if freed > 5*time.Second {
		t.Fatalf("B's reservations were released %v after the Host restarted (their lease, not the Host)", freed)
	}
	t.Logf("the Host restarted %v after it died; B's reservations released %v after its start (it serves from then)",
		restarted.Sub(died).Round(time.Millisecond), freed.Round(time.Millisecond))
	st := d.status(t, listMigrations(t, d.hostURL)[0].ID)
	if st.State != hostapi.StateAborted || !strings.Contains(st.Error, "released the target's reservations") {
		t.Fatalf("the restarted Host's record: %+v", st)
	}
	<-viaHost // those streams broke with the Host: nothing can carry them
	for i, s := range <-direct {
		if s.Err != nil || s.Done != 1 {
			t.Fatalf("stream %d to A did not finish after the Host died: %v", i, s.Err)
		}
	}
	waitUntil(t, "A and B back to all blocks free", func() bool {
		a, b := d.stats(t, d.aURL), d.stats(t, d.bURL)
		return a.Running == 0 && a.Free == a.Total && b.Free == b.Total && b.Reserved == 0
	})
}

// hostMetrics checks that the Host's /metrics has every line of want.
func hostMetrics(t *testing.T, hostURL string, want ...string) {
	t.Helper()
	framework.HostMetrics(t, hostURL, want...)
}

func listMigrations(t *testing.T, hostURL string) []hostapi.MigrationStatus {
	t.Helper()
	list, err := hostClient(t, hostURL, "").Migrations(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return list
}

// vhi bench migrate --host runs the benchmark against a running
// deployment (what hack/gpu-vllm-bench.sh does with real vLLM): it finds
// the source and target, takes the reference through the Host, migrates
// under load, wakes the retired source and migrates back for the next run.
func TestBenchMigrateAgainstADeployment(t *testing.T) {
	d := deploy(t, 4096)
	out, err := exec.Command(vhiBin, "bench", "migrate", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile,
		"--streams", "6", "--max-tokens", "400", "--prompt-words", "20", "--delay", "300ms",
		"--final-granularity", "slot,block").CombinedOutput()
	if err != nil {
		t.Fatalf("vhi bench migrate --host: %v\n%s", err, out)
	}
	if n := strings.Count(string(out), "every stream exact"); n != 2 {
		t.Fatalf("want two exact runs, got %d:\n%s", n, out)
	}
	if !strings.Contains(string(out), "through the Host at "+d.hostURL) {
		t.Fatalf("the report does not name the deployment:\n%s", out)
	}
	// Nothing to migrate to: a clear error, non-zero exit.
	out, err = exec.Command(vhiBin, "bench", "migrate", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile,
		"--model", "no-such-model").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "no migratable active and standby instance of no-such-model") {
		t.Fatalf("an unknown model: %v\n%s", err, out)
	}
}

// `vhi drain B --wait` while A and B (both active) stream a load: B's
// streams move to A by migration, each exact; the CLI shows each
// migration and a summary, and exits non-zero for a drain it cannot make.
func TestDrainByCLI(t *testing.T) {
	d := deployWith(t, deployOptions{bBlocks: 4096, bActive: true})
	reqs := load(32, 400)
	want := d.reference(reqs)
	release := framework.HoldStreams(t, d, "B") // B's streams wait for the drain to move them
	running := d.startLoad(reqs)
	time.Sleep(900 * time.Millisecond)
	if out, err := exec.Command(vhiBin, "drain", "nope", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile).CombinedOutput(); exitCodeOf(err) != 4 ||
		!strings.Contains(string(out), "nope") {
		t.Fatalf("vhi drain of an unknown instance: %v (want exit 4, not found)\n%s", err, out)
	}
	out, err := exec.Command(vhiBin, "drain", "B", "--wait", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile).CombinedOutput()
	release()
	if err != nil {
		t.Fatalf("vhi drain --wait: %v\n%s", err, out)
	}
	for _, w := range []string{"B → A: succeeded", "succeeded", "released"} {
		if !strings.Contains(string(out), w) {
			t.Fatalf("vhi drain --wait output lacks %q:\n%s", w, out)
		}
	}
	t.Logf("vhi drain B --wait:\n%s", out)
	checkExact(t, <-running, want)
	if in := instance(t, d.hostURL, "B"); in.Lifecycle != "retired" {
		t.Fatalf("B is %s after its drain", in.Lifecycle)
	}
	// A is the model's last active instance now: draining it would take
	// the model offline, so the CLI refuses it unless --force.
	out, err = exec.Command(vhiBin, "drain", "A", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile).CombinedOutput()
	if exitCodeOf(err) != 5 || !strings.Contains(string(out), "last active instance of model m") || !strings.Contains(string(out), "--force") {
		t.Fatalf("vhi drain of the model's last active instance: %v (want exit 5, a conflict)\n%s", err, out)
	}
	// The histories as lists.
	out, err = exec.Command(vhiBin, "drains", "--host", d.hostURL).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "succeeded") || !strings.Contains(string(out), "drain-") {
		t.Fatalf("vhi drains: %v\n%s", err, out)
	}
	out, err = exec.Command(vhiBin, "migrations", "-o", "yaml", "--host", d.hostURL).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "state: succeeded") || !strings.Contains(string(out), "src_vllm_hi_id: B") {
		t.Fatalf("vhi migrations -o yaml: %v\n%s", err, out)
	}
	if in := instance(t, d.hostURL, "A"); in.Lifecycle != "active" {
		t.Fatalf("a refused drain left A %s", in.Lifecycle)
	}
	hostMetrics(t, d.hostURL, `vhi_drains_total{state="succeeded"} 1`, `vhi_drains_total{state="refused"} 2`)
	// Back to serving: B woken active takes requests again.
	out, err = exec.Command(vhiBin, "wake", "B", "--active", "--host", d.hostURL, "--admin-token-file", d.tk.adminFile).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "B is active (active)") {
		t.Fatalf("vhi wake B --active: %v\n%s", err, out)
	}
	waitUntil(t, "B serving again", func() bool {
		in := instance(t, d.hostURL, "B")
		return in.Lifecycle == "active" && in.Role == "active"
	})
}

// exitCodeOf is the exit status of a command exec.Command ran (0: none).
func exitCodeOf(err error) int {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return ee.ExitCode()
	}
	if err != nil {
		return -1
	}
	return 0
}

// hostDiesInThePause streams to A — straight (those keep their
// connections when the Host dies) and through the Host (the streams a
// migration moves) — and has the Host exit inside a migration's pause
// (crash_after_pause), A paused; it returns both loads.
func (d *deployment) hostDiesInThePause(t *testing.T) (direct, viaHost <-chan []loadgen.Stream) {
	t.Helper()
	straight := make(chan []loadgen.Stream, 1)
	reqs := load(8, 400)
	go func() {
		straight <- loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.aURL, Model: "m"}, reqs)
	}()
	relayed := d.startLoad(load(8, 400))
	time.Sleep(300 * time.Millisecond)
	if code, body := d.migrate(t, `{"src_vllm_hi_id":"A","dst_vllm_hi_id":"B","inject_fault":"crash_after_pause"}`); code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	_ = d.host.cmd.Wait() // the Host exits with A paused
	return straight, relayed
}

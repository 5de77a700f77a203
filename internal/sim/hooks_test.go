package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// copyBlocks copies whole blocks from one engine's KV files to another's,
// as a data plane would: by kvlayout.Plan over the layouts' strides, so the
// two sides may order a block differently (HND and NHD).
func copyBlocks(t *testing.T, src, dst hooks.Layout, from, to []int) {
	t.Helper()
	var copies []kvlayout.BlockCopy
	for j := range from {
		copies = append(copies, kvlayout.BlockCopy{Src: from[j], Dst: to[j], NumSlots: src.Geometry.BlockSize})
	}
	g := src.Geometry
	runs, err := kvlayout.Plan(g.Layers, g.KVHeads, int64(g.HeadDim*g.DTypeBytes), transfer.Specs(src), transfer.Specs(dst), copies)
	if err != nil {
		t.Fatal(err)
	}
	open := func(l hooks.Layout, flag int) []*os.File {
		var fs []*os.File
		for _, r := range l.Regions {
			f, err := os.OpenFile(r.Memory.Path, flag, 0)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			fs = append(fs, f)
		}
		return fs
	}
	fs, fd := open(src, os.O_RDONLY), open(dst, os.O_RDWR)
	for _, r := range runs {
		buf := make([]byte, r.Length)
		if _, err := fs[r.SrcRegion].ReadAt(buf, r.SrcOffset); err != nil {
			t.Fatal(err)
		}
		if _, err := fd[r.DstRegion].WriteAt(buf, r.DstOffset); err != nil {
			t.Fatal(err)
		}
	}
}

type streamResult struct {
	events []string
	err    error
}

func streamCompletion(t *testing.T, url, id, body string) <-chan streamResult {
	t.Helper()
	ch := make(chan streamResult, 1)
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", id)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			ch <- streamResult{err: err}
			return
		}
		defer resp.Body.Close()
		ev, err := readSSE(resp.Body)
		ch <- streamResult{ev, err}
	}()
	return ch
}

func textOf(t *testing.T, events []string) (string, int) {
	t.Helper()
	var text strings.Builder
	done := 0
	for _, ev := range events {
		if ev == "[DONE]" {
			done++
			continue
		}
		var c struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(ev), &c); err != nil {
			t.Fatalf("bad event %s", ev)
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Text)
		}
	}
	return text.String(), done
}

// The hooks carry a request from A to B mid-stream: pause, export,
// allocate, copy KV, install, silent abort on A, attach on B. The text the
// client would see (A's part, then B's from the next token) equals an
// unmigrated run, and both engines end with every block free — between
// engines of either KV layout, since the tokens follow the KV's values,
// not where a layout puts them.
func TestHooksMoveARequest(t *testing.T) {
	for _, ls := range [][2]string{{"HND", "HND"}, {"HND", "NHD"}, {"NHD", "HND"}, {"NHD", "NHD"}} {
		t.Run(ls[0]+"→"+ls[1], func(t *testing.T) { testHooksMoveARequest(t, ls[0], ls[1]) })
	}
}

func testHooksMoveARequest(t *testing.T, layoutA, layoutB string) {
	ca, cb := testConfig(t), testConfig(t)
	ca.KVLayout, cb.KVLayout = layoutA, layoutB
	ca.Step.Fixed, cb.Step.Fixed = 4*time.Millisecond, 4*time.Millisecond
	a, b := startEngine(t, ca), startEngine(t, cb)
	_, tsA := startServer(t, a)
	_, tsB := startServer(t, b)
	ctx := context.Background()
	body := `{"model":"test-model","prompt":"move me across please","max_tokens":90,"temperature":0.7,"seed":5,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`

	ref := <-streamCompletion(t, tsA.URL, "ref", body)
	refText, _ := textOf(t, ref.events)

	live := streamCompletion(t, tsA.URL, "mig", body)
	id := "cmpl-mig"
	deadline := time.Now().Add(5 * time.Second)
	for {
		o, err := a.Watch(ctx, id, 0)
		if err == nil && o.NumOutput >= 25 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("request never produced 25 tokens")
		}
		time.Sleep(2 * time.Millisecond)
	}
	freeB0, _ := b.Stats(ctx)
	// A running request exports only as a snapshot; an unknown one is left
	// out of it.
	var se *Error
	if _, err := a.Export(ctx, hooks.ExportRequest{RequestIDs: []string{id}}); !errors.As(err, &se) || se.Status != http.StatusConflict {
		t.Fatalf("export of a running request: %v", err)
	}
	if snap, err := a.Export(ctx, hooks.ExportRequest{RequestIDs: []string{id, "gone"}, Snapshot: true}); err != nil ||
		len(snap.Requests) != 1 || snap.Requests[0].RequestID != id || len(snap.Requests[0].OutputTokenIDs) < 25 {
		t.Fatalf("snapshot: %v %+v", err, snap)
	}

	if _, err := a.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{id}, LeaseMS: 5000}); err != nil {
		t.Fatal(err)
	}
	exp, err := a.Export(ctx, hooks.ExportRequest{RequestIDs: []string{id}})
	if err != nil {
		t.Fatal(err)
	}
	st := exp.Requests[0]
	if st.NumComputedTokens != len(st.PromptTokenIDs)+len(st.OutputTokenIDs)-1 {
		t.Fatalf("paused mid-step? computed %d of %d+%d", st.NumComputedTokens, len(st.PromptTokenIDs), len(st.OutputTokenIDs))
	}
	// A pre-attach opened before the install streams from where the
	// request is installed, as the attach after the commit does.
	preText := make(chan string, 1)
	go func() {
		resp, err := http.Get(tsB.URL + hooks.PreAttachPath(id, 5*time.Second))
		if err != nil || resp.StatusCode != http.StatusOK {
			preText <- fmt.Sprintf("pre-attach: %v %v", err, resp)
			return
		}
		ev, err := readSSE(resp.Body)
		resp.Body.Close()
		if err != nil {
			preText <- "pre-attach: " + err.Error()
			return
		}
		text, _ := textOf(t, ev)
		preText <- text
	}()
	alloc, err := b.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: id, NumTokens: len(st.PromptTokenIDs) + len(st.OutputTokenIDs)}}})
	if err != nil {
		t.Fatal(err)
	}
	// As the Host does: install paused while the KV is still on its way,
	// then commit with a resume once it landed.
	st.BlockIDs = alloc.Requests[0].BlockIDs
	if _, err := b.Install(ctx, hooks.InstallRequest{Requests: []hooks.RequestState{st}, LeaseMS: 5000}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * cb.Step.Fixed)
	if o, err := b.Watch(ctx, id, 0); err != nil || o.NumOutput != len(st.OutputTokenIDs) {
		t.Fatalf("an installed request stepped before its resume: %+v %v", o, err)
	}
	layA, _ := a.Layout(ctx)
	layB, _ := b.Layout(ctx)
	used := (st.NumComputedTokens + ca.BlockSize - 1) / ca.BlockSize
	copyBlocks(t, layA, layB, exp.Requests[0].BlockIDs[:used], alloc.Requests[0].BlockIDs[:used])
	if _, err := b.Resume(ctx, hooks.ResumeRequest{RequestIDs: []string{id}}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{id}, Silent: true}); err != nil {
		t.Fatal(err)
	}
	onA := <-live
	if onA.err == nil {
		t.Fatalf("A's stream ended cleanly after a silent abort; want a cut connection")
	}
	textA, doneA := textOf(t, onA.events)
	if doneA != 0 {
		t.Fatalf("A sent [DONE] after a silent abort")
	}
	k := len(st.OutputTokenIDs)
	resp, err := http.Get(tsB.URL + "/vllm_hi/engine/requests/" + id + "/stream?from=" + itoa(k))
	if err != nil {
		t.Fatal(err)
	}
	evB, err := readSSE(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	textB, doneB := textOf(t, evB)
	if doneB != 1 {
		t.Fatalf("B's stream had %d [DONE]", doneB)
	}
	if got := textA + textB; got != refText {
		t.Fatalf("migrated text differs:\n got %q\nwant %q", got, refText)
	}
	if pre := <-preText; pre != textB {
		t.Fatalf("the pre-attached stream: %q, the attach after the commit: %q", pre, textB)
	}
	for path, code := range map[string]int{
		"/vllm_hi/engine/requests/" + id + "/stream?from=-1":                 http.StatusBadRequest, // a pre-attach names its wait
		"/vllm_hi/engine/requests/" + id + "/stream?from=-2&wait_ms=10":      http.StatusBadRequest,
		"/vllm_hi/engine/requests/never-installed/stream?from=-1&wait_ms=50": http.StatusNotFound,
	} {
		resp, err := http.Get(tsB.URL + path)
		if err != nil || resp.StatusCode != code {
			t.Fatalf("%s: %v %v, want %d", path, err, resp, code)
		}
		resp.Body.Close()
	}
	if !strings.Contains(evB[len(evB)-2], `"completion_tokens":90`) {
		t.Fatalf("usage after the move: %s", evB[len(evB)-2])
	}
	sa, _ := a.Stats(ctx)
	sb, _ := b.Stats(ctx)
	if sa.FreeBlocks != sa.TotalBlocks || sb.FreeBlocks != freeB0.FreeBlocks {
		t.Fatalf("blocks leaked: A %+v, B %+v", sa, sb)
	}
}

// An aborted move: B's reservation is released, A resumes, the stream
// finishes on A exactly as if nothing happened.
func TestHooksAbortedMove(t *testing.T) {
	c := testConfig(t)
	c.Step.Fixed = 3 * time.Millisecond
	a, b := startEngine(t, c), startEngine(t, testConfig(t))
	_, tsA := startServer(t, a)
	ctx := context.Background()
	body := `{"model":"test-model","prompt":"stay here","max_tokens":60,"temperature":0,"ignore_eos":true,"stream":true}`
	ref := <-streamCompletion(t, tsA.URL, "ref", body)
	live := streamCompletion(t, tsA.URL, "stay", body)
	id := "cmpl-stay"
	for {
		if o, err := a.Watch(ctx, id, 0); err == nil && o.NumOutput >= 10 {
			break
		}
		time.Sleep(2 * time.Millisecond)
	}
	b0, _ := b.Stats(ctx)
	if _, err := a.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{id}}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: id, NumTokens: 100}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{id}, Silent: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Resume(ctx, hooks.ResumeRequest{RequestIDs: []string{id}}); err != nil {
		t.Fatal(err)
	}
	got := <-live
	if got.err != nil {
		t.Fatal(got.err)
	}
	gotText, done := textOf(t, got.events)
	refText, _ := textOf(t, ref.events)
	if gotText != refText || done != 1 {
		t.Fatalf("stream after an aborted move differs (done=%d)", done)
	}
	b1, _ := b.Stats(ctx)
	if b1.FreeBlocks != b0.FreeBlocks {
		t.Fatalf("B leaked blocks: %d → %d", b0.FreeBlocks, b1.FreeBlocks)
	}
}

// A paused engine resumes by itself when nobody confirms within the lease,
// and an unclaimed reservation is released when its lease ends.
func TestLeasesExpire(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	if err := e.Submit(NewRequest{ID: "lease", Prompt: prompt(10, 1), Params: greedy(40), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Watch(ctx, "lease", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"lease"}, LeaseMS: 80}); err != nil {
		t.Fatal(err)
	}
	if o := waitFinished(t, e, "lease"); o.Reason != "length" {
		t.Fatalf("did not resume after the lease: %s", o.Reason)
	}
	before, _ := e.Stats(ctx)
	if _, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "r", NumTokens: 64}}, LeaseMS: 50}); err != nil {
		t.Fatal(err)
	}
	mid, _ := e.Stats(ctx)
	if mid.ReservedBlocks != 16 {
		t.Fatalf("reserved %d blocks, want 16", mid.ReservedBlocks)
	}
	waitReservationsFreed(t, e, before.FreeBlocks)
}

// waitReservationsFreed waits up to 2 s for e to hold no reservation and
// free blocks again.
func waitReservationsFreed(t *testing.T, e *Engine, free int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		s, _ := e.Stats(context.Background())
		if s.FreeBlocks == free && s.ReservedBlocks == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("reservation not released: %+v", s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A request installed on a target but never committed (the Host died
// before the resume) is dropped when its lease ends, its blocks freed,
// without producing a token: the source still has it.
func TestUncommittedInstallIsDropped(t *testing.T) {
	a, b := startEngine(t, testConfig(t)), startEngine(t, testConfig(t))
	ctx := context.Background()
	if err := a.Submit(NewRequest{ID: "r", Prompt: prompt(10, 1), Params: greedy(400), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Watch(ctx, "r", 3); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"r"}}); err != nil {
		t.Fatal(err)
	}
	exp, err := a.Export(ctx, hooks.ExportRequest{RequestIDs: []string{"r"}})
	if err != nil {
		t.Fatal(err)
	}
	before, _ := b.Stats(ctx)
	if _, err := b.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "r", NumTokens: 500}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Install(ctx, hooks.InstallRequest{Requests: exp.Requests, LeaseMS: 60}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(3 * time.Second)
	for {
		s, _ := b.Stats(ctx)
		if s.FreeBlocks == before.FreeBlocks && s.NumRunning == 0 && s.NumPaused == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("uncommitted install not dropped: %+v", s)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if o, err := b.Watch(ctx, "r", 0); err == nil && o.NumOutput != len(exp.Requests[0].OutputTokenIDs) {
		t.Fatalf("the uncommitted request produced tokens on the target: %+v", o)
	}
	if _, err := b.Resume(ctx, hooks.ResumeRequest{RequestIDs: []string{"r"}}); err == nil {
		t.Fatal("a dropped install could still be resumed")
	}
}

// A pause waits for the step in flight and says how long it waited: the
// requests decoded until then, so a migration's downtime starts after it.
func TestPauseReportsItsStepWait(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	if err := e.Submit(NewRequest{ID: "w", Prompt: prompt(10, 1), Params: greedy(400), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Watch(ctx, "w", 2); err != nil {
		t.Fatal(err)
	}
	e.lock() // a step in flight
	got := make(chan hooks.PauseResponse, 1)
	go func() {
		p, _ := e.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"w"}})
		got <- p
	}()
	time.Sleep(40 * time.Millisecond)
	e.mu.Unlock()
	if p := <-got; p.StepWaitS < 0.04 || len(p.Paused) != 1 {
		t.Fatalf("pause after a 40 ms step reported %+v", p)
	}
}

// Changes since a cursor name the written slots and freed blocks.
func TestChangesSinceCursor(t *testing.T) {
	c := testConfig(t)
	c.Step.Fixed = 2 * time.Millisecond
	e := startEngine(t, c)
	ctx := context.Background()
	if err := e.Submit(NewRequest{ID: "w", Prompt: prompt(9, 1), Params: greedy(30), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	o, _ := e.Watch(ctx, "w", 0)
	_ = o
	c0, _ := e.Changes(ctx, 0)
	if len(c0.Written) == 0 {
		t.Fatal("no written blocks after prefill")
	}
	time.Sleep(20 * time.Millisecond)
	c1, err := e.Changes(ctx, c0.Cursor)
	if err != nil {
		t.Fatal(err)
	}
	if len(c1.Written) == 0 || len(c1.Written) > 3 {
		t.Fatalf("after a few decode steps: %d blocks written, want 1..3: %+v", len(c1.Written), c1.Written)
	}
	for _, w := range c1.Written {
		if w.RequestID != "w" || w.NumSlots < 1 || w.FirstSlot+w.NumSlots > c.BlockSize {
			t.Fatalf("bad write record %+v", w)
		}
	}
	waitFinished(t, e, "w")
	c2, _ := e.Changes(ctx, c1.Cursor)
	if len(c2.Freed) == 0 {
		t.Fatal("finished request's blocks not reported freed")
	}
	if c3, _ := e.Changes(ctx, c2.Cursor); len(c3.Written)+len(c3.Freed) != 0 {
		t.Fatalf("changes with nothing happening: %+v", c3)
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// Client streams read a request's published output without the engine's
// lock: a step in flight (which holds it) does not hold them up, nor does
// attaching to a request.
func TestWatchersDoNotWaitForAStep(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	if err := e.Submit(NewRequest{ID: "v", Prompt: prompt(10, 1), Params: greedy(400), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	for n := 0; n < 4; {
		o, err := e.Watch(ctx, "v", n)
		if err != nil {
			t.Fatal(err)
		}
		n = o.NumOutput
	}
	e.lock() // a step in flight
	defer e.mu.Unlock()
	got := make(chan error, 1)
	go func() {
		o, err := e.Watch(ctx, "v", 1)
		if err == nil && (o.From != 1 || len(o.Tokens) < 2 || o.TextBefore == 0) {
			err = fmt.Errorf("unexpected output %+v", o)
		}
		got <- err
	}()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("a watcher waited for the engine's lock")
	}
	if _, err := e.Watcher("nobody"); err == nil {
		t.Fatal("a watcher of an unknown request")
	}
}

// An install is checked whole before anything changes: computed tokens
// beyond the reservation (which panicked the handler half-way), text
// offsets past the text (which would panic a stream), a request named
// twice, or out-of-vocabulary tokens are refused, and the engine is left
// as it was.
func TestMalformedInstallsChangeNothing(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	if _, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "r", NumTokens: 4}, {RequestID: "s", NumTokens: 40}}}); err != nil {
		t.Fatal(err)
	}
	before, _ := e.Stats(ctx)
	good := func(id string) hooks.RequestState {
		return hooks.RequestState{RequestID: id, PromptTokenIDs: []int{5, 6, 7}, OutputTokenIDs: []int{8}, NumComputedTokens: 3,
			Sampling: hooks.SamplingParams{Temperature: 1, TopP: 1, MaxTokens: 9}, OutputText: "x", TextOffsets: []int{1}}
	}
	long := good("r")
	long.PromptTokenIDs = make([]int, 20)
	long.NumComputedTokens = 20
	offsets := good("r")
	offsets.TextOffsets = []int{9}
	vocab := good("r")
	vocab.OutputTokenIDs = []int{1 << 30}
	nan := good("r")
	nan.Sampling.Temperature = math.NaN()
	for name, states := range map[string][]hooks.RequestState{
		"computed tokens beyond the reservation": {good("s"), long},
		"text offsets past the text":             {offsets},
		"a request named twice":                  {good("r"), good("r")},
		"a token out of vocabulary":              {vocab},
		"a NaN temperature":                      {nan},
	} {
		if _, err := e.Install(ctx, hooks.InstallRequest{Requests: states, Resume: true}); err == nil {
			t.Errorf("%s: installed", name)
		}
		if after, _ := e.Stats(ctx); after.NumRunning != 0 || after.ReservedBlocks != before.ReservedBlocks || after.FreeBlocks != before.FreeBlocks {
			t.Fatalf("%s changed the engine: %+v, before %+v", name, after, before)
		}
	}
	if _, err := e.Install(ctx, hooks.InstallRequest{Requests: []hooks.RequestState{good("r"), good("s")}, Resume: true}); err != nil {
		t.Fatalf("the good states: %v", err)
	}
}

// An abort with ReservedOnly drops reservations and uncommitted installs
// only: a running request it names goes on (a restarted Host releases a
// dead migration's reservations so, not knowing whether its commit
// reached the engine).
func TestAbortReservedOnlyLeavesRunningRequests(t *testing.T) {
	a, b := startEngine(t, testConfig(t)), startEngine(t, testConfig(t))
	ctx := context.Background()
	for _, id := range []string{"moved", "running"} {
		if err := a.Submit(NewRequest{ID: id, Prompt: prompt(10, 1), Params: greedy(400), SeedSet: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := a.Watch(ctx, id, 3); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Submit(NewRequest{ID: "running", Prompt: prompt(10, 1), Params: greedy(400), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"moved"}}); err != nil {
		t.Fatal(err)
	}
	exp, err := a.Export(ctx, hooks.ExportRequest{RequestIDs: []string{"moved"}})
	if err != nil {
		t.Fatal(err)
	}
	items := []hooks.AllocateItem{{RequestID: "moved", NumTokens: 500}, {RequestID: "reserved", NumTokens: 64}}
	if _, err := b.Allocate(ctx, hooks.AllocateRequest{Requests: items}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Install(ctx, hooks.InstallRequest{Requests: exp.Requests}); err != nil { // uncommitted
		t.Fatal(err)
	}
	out, err := b.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{"moved", "reserved", "running", "gone"}, Silent: true, ReservedOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(out.Aborted, ","); got != "moved,reserved" {
		t.Fatalf("aborted %q, want the uncommitted install and the reservation", got)
	}
	s, _ := b.Stats(ctx)
	if s.ReservedBlocks != 0 || s.NumPaused != 0 || s.NumRunning+s.NumWaiting != 1 {
		t.Fatalf("after the abort: %+v", s)
	}
	if o, err := b.Watch(ctx, "running", 0); err != nil || o.Finished {
		t.Fatalf("the running request was touched: %+v %v", o, err)
	}
}

// A pause that ignores missing requests pauses those still running and
// names the others; without it, one ended request refuses the whole call;
// and when every named request is gone it pauses none (not all).
func TestPauseIgnoresRequestsThatEnded(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	for _, id := range []string{"live", "other"} {
		if err := e.Submit(NewRequest{ID: id, Prompt: prompt(10, 1), Params: greedy(400), SeedSet: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := e.Watch(ctx, id, 0); err != nil {
			t.Fatal(err)
		}
	}
	var notFound *Error
	if _, err := e.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"live", "ended"}}); !errors.As(err, &notFound) || notFound.Status != http.StatusNotFound {
		t.Fatalf("a pause naming an ended request: %v, want not found", err)
	}
	p, err := e.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"ended"}, IgnoreMissing: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Paused) != 0 || !slices.Equal(p.Missing, []string{"ended"}) {
		t.Fatalf("only ended requests named: paused %v, missing %v", p.Paused, p.Missing)
	}
	p, err = e.Pause(ctx, hooks.PauseRequest{RequestIDs: []string{"live", "ended"}, LeaseMS: 5000, IgnoreMissing: true})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(p.Paused, []string{"live"}) || !slices.Equal(p.Missing, []string{"ended"}) {
		t.Fatalf("paused %v, missing %v; want [live] and [ended]", p.Paused, p.Missing)
	}
	list, err := e.Requests(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range list.Requests {
		if want := r.RequestID == "live"; r.Paused != want {
			t.Fatalf("%s paused=%v, want %v", r.RequestID, r.Paused, want)
		}
	}
}

// A reservation renewed (Allocate with Extend) is held past its first
// lease and ends with the renewed one; an extend of a request that holds
// no reservation (running, or unknown) renews nothing and changes
// nothing.
func TestReservationsAreRenewedByExtend(t *testing.T) {
	e := startEngine(t, testConfig(t))
	ctx := context.Background()
	before, _ := e.Stats(ctx)
	alloc, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "r", NumTokens: 64}}, LeaseMS: 150})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 4; i++ {
		time.Sleep(80 * time.Millisecond)
		ext, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "r"}, {RequestID: "nobody"}}, LeaseMS: 150, Extend: true})
		if err != nil {
			t.Fatal(err)
		}
		if len(ext.Requests) != 1 || ext.Requests[0].RequestID != "r" || !slices.Equal(ext.Requests[0].BlockIDs, alloc.Requests[0].BlockIDs) {
			t.Fatalf("extend %d answered %+v, want r with its blocks %v", i, ext.Requests, alloc.Requests[0].BlockIDs)
		}
	}
	if s, _ := e.Stats(ctx); s.ReservedBlocks != 16 {
		t.Fatalf("after 320 ms of renewals of a 150 ms lease: %d blocks reserved, want 16", s.ReservedBlocks)
	}
	waitReservationsFreed(t, e, before.FreeBlocks)
	ext, err := e.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "r"}}, LeaseMS: 150, Extend: true})
	if err != nil || len(ext.Requests) != 0 {
		t.Fatalf("extend of an expired reservation: %+v, %v", ext.Requests, err)
	}
}

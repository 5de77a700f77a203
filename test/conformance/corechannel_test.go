package conformance

import (
	"context"
	"errors"
	"reflect"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// coreRequests is the engine core's request list as the core channel
// answers it.
type coreRequests struct {
	Requests []struct {
		ID        string `json:"request_id"`
		Paused    bool   `json:"paused"`
		NumOutput int    `json:"num_output_tokens"`
		Stream    bool   `json:"stream"`
	} `json:"requests"`
}

// The core channel on real vLLM: the agent's direct line into the engine
// core refuses a wrong token; under a load of streams its commands run at
// a step boundary (the wait for one under a step or two) and its snapshot
// answers at once; a request paused through it stops exactly (no token
// while paused) and, resumed, ends with the tokens an unpaused run gives.
func TestCoreChannelOnVLLM(t *testing.T) {
	vllmA := needVLLM(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := engine.DialCore(ctx, coreSockets["A"], "not-the-agent-token"); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Fatalf("a wrong token: %v", err)
	}
	ch, err := engine.DialCore(ctx, coreSockets["A"], agentToken)
	if err != nil {
		t.Fatalf("%v\n%s", err, tail(vllmLogs.String()))
	}
	defer ch.Close()
	// The hello lists what the channel takes: the migrations of
	// TestMigrateBetweenVLLMServers install over it (and the API server
	// beside it) only where it lists "install".
	for _, op := range []string{"pause", "export", "resume", "allocate", "install", "stats", "layout", "round"} {
		if !ch.Takes(op) {
			t.Fatalf("the core channel's hello does not list %q", op)
		}
	}

	const n = 4
	want := runStreamsFrom(t, vllmA, 20, n, nil)
	hooksClient, err := engine.NewClient(vllmA, engine.Options{Token: agentToken})
	if err != nil {
		t.Fatal(err)
	}
	// The layout the agent's copies and checks read over the channel is
	// the API server's hook's, but for the served names (the API server's
	// flags): the model stands in for them.
	var viaChannel hooks.Layout
	if _, err := ch.Call(ctx, "layout", nil, &viaChannel); err != nil {
		t.Fatal(err)
	}
	viaHook, err := hooksClient.Layout(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(viaChannel.ServedModels, []string{viaHook.Model}) {
		t.Fatalf("the channel's layout serves %v, want the model %q", viaChannel.ServedModels, viaHook.Model)
	}
	// A copy round's inputs in one op: the same layout, the request list
	// and the changes since a cursor.
	var round engine.RoundInputs
	if _, err := ch.Call(ctx, "round", map[string]any{"since": 0}, &round); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(round.Layout, viaChannel) || round.Changes == nil || round.Requests.TotalBlocks == 0 {
		t.Fatalf("the round's inputs %+v, want the layout %+v, changes and the request list", round, viaChannel)
	}
	viaChannel.ServedModels = viaHook.ServedModels
	if !reflect.DeepEqual(viaChannel, viaHook) || len(viaHook.Regions) == 0 {
		t.Fatalf("the channel's layout %+v, the API server's hook's %+v", viaChannel, viaHook)
	}
	var waits, snaps, viaHTTP []time.Duration
	var step time.Duration
	loaded := false
	got := runStreamsFrom(t, vllmA, 20, n, func() {
		// First what must hold whatever the machine's speed: every stream
		// paused through the channel at once (none can end meanwhile).
		var paused struct{ Paused []string }
		if _, err := ch.Call(ctx, "pause", map[string]any{"lease_ms": 30000}, &paused); err != nil {
			t.Fatal(err)
		}
		if len(paused.Paused) != n {
			t.Fatalf("paused %v, want the %d streams", paused.Paused, n)
		}
		// The channel names requests as the API server's hooks do (the
		// Host's ids), streams as streams.
		var list coreRequests
		if _, err := ch.Call(ctx, "requests", nil, &list); err != nil {
			t.Fatal(err)
		}
		httpList, err := hooksClient.Requests(ctx)
		if err != nil {
			t.Fatal(err)
		}
		names := map[string]bool{}
		for _, r := range httpList.Requests {
			names[r.RequestID] = r.Stream
		}
		if len(list.Requests) != n || len(names) != n {
			t.Fatalf("the channel lists %d requests, the API server's hook %d; want %d", len(list.Requests), len(names), n)
		}
		before := map[string]int{}
		for _, r := range list.Requests {
			if stream, ok := names[r.ID]; !ok || !stream || !r.Stream || !r.Paused {
				t.Fatalf("the channel lists %s (stream %v, paused %v); the API server's hook %v", r.ID, r.Stream, r.Paused, names)
			}
			before[r.ID] = r.NumOutput
		}
		// Paused requests do not move.
		time.Sleep(100 * time.Millisecond)
		if _, err := ch.Call(ctx, "requests", nil, &list); err != nil {
			t.Fatal(err)
		}
		for _, r := range list.Requests {
			if r.NumOutput != before[r.ID] {
				t.Fatalf("a paused request moved on: %s %d → %d tokens", r.ID, before[r.ID], r.NumOutput)
			}
		}
		var resumed struct{ Resumed []string }
		if _, err := ch.Call(ctx, "resume", map[string]any{"request_ids": paused.Paused}, &resumed); err != nil {
			t.Fatal(err)
		}
		if len(resumed.Resumed) != n {
			t.Fatalf("resumed %v", resumed.Resumed)
		}
		// A reserved-only abort (a restarted Host's release of a dead
		// migration's reservations) drops the reservation it names and
		// leaves the running stream it names alone: the streams are
		// compared with their runs below.
		if _, err := hooksClient.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: "resv-1", NumTokens: 64}}}); err != nil {
			t.Fatal(err)
		}
		ab, err := hooksClient.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{"resv-1", paused.Paused[0]}, Silent: true, IgnoreMissing: true, ReservedOnly: true})
		if err != nil || len(ab.Aborted) != 1 || ab.Aborted[0] != "resv-1" {
			t.Fatalf("a reserved-only abort: %+v %v (want resv-1 alone)", ab, err)
		}
		if st, err := hooksClient.Stats(ctx); err != nil || st.ReservedBlocks != 0 {
			t.Fatalf("after a reserved-only abort: %+v %v", st, err)
		}

		// Then timings, side by side, while the streams run (they may end
		// meanwhile on a fast machine: the ratio is checked only under load).
		var p0, p1 struct{ Steps int }
		if _, err := ch.Call(ctx, "ping", nil, &p0); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		for i := 0; i < 10; i++ {
			tm, err := ch.Call(ctx, "requests", nil, &list)
			if err != nil {
				t.Fatal(err)
			}
			waits = append(waits, tm.Total)
			tm, err = ch.Call(ctx, "stats", nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			snaps = append(snaps, tm.Total)
			// The same list through the API server, side by side.
			h0 := time.Now()
			if _, err := hooksClient.Requests(ctx); err != nil {
				t.Fatal(err)
			}
			viaHTTP = append(viaHTTP, time.Since(h0))
		}
		if _, err := ch.Call(ctx, "ping", nil, &p1); err != nil {
			t.Fatal(err)
		}
		if steps := p1.Steps - p0.Steps; steps > 0 {
			step = time.Since(t0) / time.Duration(steps)
			loaded = len(list.Requests) == n // still running at the end: a step each time
		}
	})
	sameStreams(t, want, got)
	for _, d := range [][]time.Duration{waits, snaps, viaHTTP} {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	}
	med := func(d []time.Duration) time.Duration { return d[len(d)/2] }
	ratio := func(d time.Duration) float64 {
		if step == 0 {
			return 0
		}
		return float64(d) / float64(step)
	}
	t.Logf("step %v (under load throughout: %v); requests through the core channel: median %v (%.2f steps), max %v; through the API server's hook: median %v (%.2f steps), max %v; "+
		"a snapshot query (stats): median %v, max %v", step, loaded, med(waits), ratio(med(waits)), waits[len(waits)-1],
		med(viaHTTP), ratio(med(viaHTTP)), viaHTTP[len(viaHTTP)-1], med(snaps), snaps[len(snaps)-1])
	// Within one step of being sent, with a step's slack for the machine.
	if m := med(waits); loaded && m > 2*step+20*time.Millisecond {
		t.Errorf("a command waited %v for a step boundary, the step being %v", m, step)
	}
}

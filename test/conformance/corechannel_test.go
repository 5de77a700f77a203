package conformance

import (
	"context"
	"errors"
	"sort"
	"testing"
	"time"

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

	const n = 4
	want := runStreamsFrom(t, vllmA, 20, n, nil)
	hooksClient, err := engine.NewClient(vllmA, engine.Options{Token: agentToken})
	if err != nil {
		t.Fatal(err)
	}
	var waits, snaps, viaHTTP []time.Duration
	var step time.Duration
	got := runStreamsFrom(t, vllmA, 20, n, func() {
		// The engine's step, from its step count over half a second.
		var p0, p1 struct{ Steps int }
		if _, err := ch.Call(ctx, "ping", nil, &p0); err != nil {
			t.Fatal(err)
		}
		time.Sleep(500 * time.Millisecond)
		if _, err := ch.Call(ctx, "ping", nil, &p1); err != nil {
			t.Fatal(err)
		}
		if p1.Steps <= p0.Steps {
			t.Fatalf("the engine made no step in 0.5 s under load: %d → %d", p0.Steps, p1.Steps)
		}
		step = 500 * time.Millisecond / time.Duration(p1.Steps-p0.Steps)
		var list coreRequests
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
			t0 := time.Now()
			if _, err := hooksClient.Requests(ctx); err != nil {
				t.Fatal(err)
			}
			viaHTTP = append(viaHTTP, time.Since(t0))
		}
		if len(list.Requests) != n {
			t.Fatalf("the engine core lists %d requests, want %d", len(list.Requests), n)
		}
		// The channel names requests as the API server's hooks do (the
		// Host's ids), streams as streams.
		httpList, err := hooksClient.Requests(ctx)
		if err != nil {
			t.Fatal(err)
		}
		names := map[string]bool{}
		for _, r := range httpList.Requests {
			names[r.RequestID] = r.Stream
		}
		for _, r := range list.Requests {
			if stream, ok := names[r.ID]; !ok || !stream || !r.Stream {
				t.Fatalf("the channel lists %s (stream %v); the API server's hook %v", r.ID, r.Stream, names)
			}
		}
		// Pause one request for a few steps: its output must not move.
		id := list.Requests[0].ID
		var paused struct{ Paused []string }
		if _, err := ch.Call(ctx, "pause", map[string]any{"request_ids": []string{id}, "lease_ms": 5000}, &paused); err != nil {
			t.Fatal(err)
		}
		if len(paused.Paused) != 1 || paused.Paused[0] != id {
			t.Fatalf("pause answered %+v", paused)
		}
		output := func() (int, bool) {
			var l coreRequests
			if _, err := ch.Call(ctx, "requests", nil, &l); err != nil {
				t.Fatal(err)
			}
			for _, r := range l.Requests {
				if r.ID == id {
					return r.NumOutput, r.Paused
				}
			}
			t.Fatalf("request %s is gone while paused", id)
			return 0, false
		}
		before, isPaused := output()
		time.Sleep(10 * step)
		after, _ := output()
		if !isPaused || after != before {
			t.Fatalf("a paused request moved on: %d → %d tokens (paused %v)", before, after, isPaused)
		}
		if _, err := ch.Call(ctx, "resume", map[string]any{"request_ids": []string{id}}, nil); err != nil {
			t.Fatal(err)
		}
	})
	sameStreams(t, want, got)
	for _, d := range [][]time.Duration{waits, snaps, viaHTTP} {
		sort.Slice(d, func(i, j int) bool { return d[i] < d[j] })
	}
	med := func(d []time.Duration) time.Duration { return d[len(d)/2] }
	t.Logf("step %v; requests through the core channel: median %v (%.2f steps), max %v; through the API server's hook: median %v (%.2f steps), max %v; "+
		"a snapshot query (stats): median %v, max %v", step, med(waits), float64(med(waits))/float64(step), waits[len(waits)-1],
		med(viaHTTP), float64(med(viaHTTP))/float64(step), viaHTTP[len(viaHTTP)-1], med(snaps), snaps[len(snaps)-1])
	// Within one step of being sent, with a step's slack for the machine.
	if med := waits[len(waits)/2]; med > 2*step+20*time.Millisecond {
		t.Errorf("a command waited %v for a step boundary, the step being %v", med, step)
	}
}

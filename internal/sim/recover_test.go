package sim

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// A request whose engine died goes on elsewhere from a snapshot of its
// state, installed to recompute: the new engine regenerates from the
// snapshot's tokens and streams from the client's place; the text is the
// unmigrated run's (what the Host's failover relies on).
func TestHooksRecoverFromASnapshot(t *testing.T) {
	c := testConfig(t)
	c.Step.Fixed = 3 * time.Millisecond
	a, b := startEngine(t, c), startEngine(t, testConfig(t))
	_, tsA := startServer(t, a)
	_, tsB := startServer(t, b)
	ctx := context.Background()
	body := `{"model":"test-model","prompt":"recover me","max_tokens":80,"temperature":0.7,"seed":5,"ignore_eos":true,"stream":true}`
	ref := <-streamCompletion(t, tsA.URL, "ref", body)
	refText, _ := textOf(t, ref.events)
	live := streamCompletion(t, tsA.URL, "lost", body)
	id := "cmpl-lost"
	for {
		if o, err := a.Watch(ctx, id, 0); err == nil && o.NumOutput >= 20 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	snap, err := a.Export(ctx, hooks.ExportRequest{RequestIDs: []string{id}, Snapshot: true})
	if err != nil || len(snap.Requests) != 1 {
		t.Fatalf("snapshot: %v %+v", err, snap)
	}
	st := snap.Requests[0]
	n := len(st.OutputTokenIDs)
	<-live // the client got everything from A: place it 10 tokens past the snapshot
	k := n + 10
	if _, err := b.Allocate(ctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: id, NumTokens: 200, Recompute: true}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Install(ctx, hooks.InstallRequest{Requests: []hooks.RequestState{st}, Resume: true}); err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get(tsB.URL + "/vllm_hi/engine/requests/" + id + "/stream?from=" + itoa(k))
	if err != nil {
		t.Fatal(err)
	}
	ev, err := readSSE(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	textB, done := textOf(t, ev)
	o, _ := a.Watch(ctx, id, 0)
	if done != 1 || o.TextOffsets == nil || refText[:o.TextOffsets[k-1]]+textB != refText {
		t.Fatalf("recovered text differs (done %d):\n got %q\nwant %q", done, refText[:o.TextOffsets[k-1]]+textB, refText)
	}
}

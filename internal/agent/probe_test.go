package agent

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/engine"
)

// An engine that answers its health check late stays healthy for the
// agent until probeTimeoutsUnhealthy checks in a row timed out; one that
// answers an error is unhealthy at once; and an answer in time resets the
// count.
func TestProbeCountsTimeoutsBeforeUnhealthy(t *testing.T) {
	var mode atomic.Int32 // 0 ok, 1 late, 2 an error
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch mode.Load() {
		case 1:
			select {
			case <-r.Context().Done():
			case <-time.After(2 * time.Second):
			}
			return
		case 2:
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer srv.Close()
	eng, err := engine.NewClient(srv.URL, engine.Options{})
	if err != nil {
		t.Fatal(err)
	}
	a := &Agent{eng: eng, log: zap.NewNop()}
	a.probe.timeout = 50 * time.Millisecond
	ctx := context.Background()
	if !a.stats(ctx).GetHealthy() {
		t.Fatal("an engine answering in time: unhealthy")
	}
	mode.Store(1)
	for i := 1; i < probeTimeoutsUnhealthy; i++ {
		if !a.stats(ctx).GetHealthy() || !a.engineHealthy {
			t.Fatalf("late answer %d of %d: unhealthy already", i, probeTimeoutsUnhealthy)
		}
	}
	if a.stats(ctx).GetHealthy() || a.engineHealthy {
		t.Fatalf("%d late answers in a row: still healthy", probeTimeoutsUnhealthy)
	}
	mode.Store(0)
	if !a.stats(ctx).GetHealthy() {
		t.Fatal("in time again: unhealthy")
	}
	mode.Store(1)
	if !a.stats(ctx).GetHealthy() {
		t.Fatal("one late answer after one in time: unhealthy (the count was not reset)")
	}
	mode.Store(2)
	if a.stats(ctx).GetHealthy() {
		t.Fatal("an engine answering 503: healthy")
	}
	if s := a.latestStats(ctx); s.GetHealthy() {
		t.Fatal("the latest reading is not the last probe's")
	}
}

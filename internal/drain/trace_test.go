package drain

import (
	"testing"
	"time"

	otelcodes "go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// An ended drain is a span naming what it moved and its migrations; a
// failed one's is an error.
func TestDrainSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	o := &Drainer{cfg: Config{Tracer: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("test")}}
	t0 := time.Date(2026, 12, 5, 1, 0, 0, 0, time.UTC)
	o.traceDrain(hostapi.DrainStatus{ID: "drain-1", Instance: "A", State: hostapi.StateFailed, Error: "timed out", Moved: 3,
		Migration: []string{"mig-1", "mig-2"}, CreatedAt: t0, FinishedAt: t0.Add(5 * time.Second)})
	spans := rec.Ended()
	if len(spans) != 1 || spans[0].Name() != "drain" || spans[0].Status().Code != otelcodes.Error || !spans[0].EndTime().Equal(t0.Add(5*time.Second)) {
		t.Fatalf("%+v", spans)
	}
	found := false
	for _, a := range spans[0].Attributes() {
		if a.Key == "vllm_hi.migrations" && len(a.Value.AsStringSlice()) == 2 {
			found = true
		}
	}
	if !found {
		t.Fatalf("the drain's migrations are not on its span: %v", spans[0].Attributes())
	}
}

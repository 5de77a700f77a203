package switching

import (
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// A switch is a span with a child per step, each timed as it ran.
func TestSwitchSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	s := &Switcher{tr: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)).Tracer("test")}
	t0 := time.Date(2026, 12, 5, 1, 0, 0, 0, time.UTC)
	s.traceSwitch(&SwitchReport{Model: "b", From: "a", State: OutcomeSucceeded, StartedAt: t0, DurationS: 3,
		Steps: []Step{{Step: "sleep", Model: "a", StartedAt: t0, DurationS: 1}, {Step: "wake", Model: "b", StartedAt: t0.Add(time.Second), DurationS: 2}}})
	spans := rec.Ended()
	if len(spans) != 3 || spans[2].Name() != "switch" || !spans[2].EndTime().Equal(t0.Add(3*time.Second)) {
		t.Fatalf("spans: %d", len(spans))
	}
	for i, want := range []struct {
		name string
		end  time.Duration
	}{{"sleep", time.Second}, {"wake", 3 * time.Second}} {
		if p := spans[i]; p.Name() != want.name || p.Parent().SpanID() != spans[2].SpanContext().SpanID() || !p.EndTime().Equal(t0.Add(want.end)) {
			t.Errorf("step %d: %s %v–%v", i, p.Name(), p.StartTime(), p.EndTime())
		}
	}
}

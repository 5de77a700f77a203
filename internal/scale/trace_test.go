package scale

import (
	"testing"
	"time"

	otelcodes "go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// An ended scale operation is a span with a child per phase, each timed
// as it ran; a failed one's is an error.
func TestScaleSpans(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	s := New(Config{Tracer: tp.Tracer("test")}, registry.New(registry.Options{}), nil, nil, "", NewMetric(), zap.NewNop())
	t0 := time.Date(2026, 12, 5, 1, 0, 0, 0, time.UTC)
	s.traceOp(hostapi.ScaleStatus{ID: "scale-1", Kind: KindReplicas, Model: "m", From: 1, To: 2, State: hostapi.StateFailed, Error: "no GPU",
		CreatedAt: t0, FinishedAt: t0.Add(3 * time.Second),
		Phases: []hostapi.ScalePhase{{Phase: "launch", Instance: "r-1", StartedAt: t0, DurationS: 2}, {Phase: "probe", StartedAt: t0.Add(2 * time.Second), DurationS: 0.5}}})
	spans := rec.Ended()
	if len(spans) != 3 {
		t.Fatalf("%d spans", len(spans))
	}
	root := spans[2]
	if root.Name() != "scale" || root.Status().Code != otelcodes.Error || !root.EndTime().Equal(t0.Add(3*time.Second)) {
		t.Fatalf("the scale span: %s %v %v", root.Name(), root.Status(), root.EndTime())
	}
	for i, want := range []struct {
		name       string
		start, end time.Duration
	}{{"launch", 0, 2 * time.Second}, {"probe", 2 * time.Second, 2500 * time.Millisecond}} {
		p := spans[i]
		if p.Name() != want.name || p.Parent().SpanID() != root.SpanContext().SpanID() || !p.StartTime().Equal(t0.Add(want.start)) || !p.EndTime().Equal(t0.Add(want.end)) {
			t.Errorf("phase %d: %s from %v to %v", i, p.Name(), p.StartTime(), p.EndTime())
		}
	}
}

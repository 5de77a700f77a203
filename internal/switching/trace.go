package switching

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// traceSwitch records an ended switch as a span with a child per step
// (Options.Tracer), from its report: the steps timed as they ran.
func (s *Switcher) traceSwitch(rep *SwitchReport) {
	if s.tr == nil {
		return
	}
	_, root := s.tr.Start(context.Background(), "switch", trace.WithTimestamp(rep.StartedAt),
		trace.WithAttributes(attribute.String("vllm_hi.model", rep.Model), attribute.String("vllm_hi.from", rep.From),
			attribute.String("vllm_hi.state", rep.State), attribute.String("vllm_hi.drain", rep.Drain)))
	ctx := trace.ContextWithSpan(context.Background(), root)
	for _, st := range rep.Steps {
		_, span := s.tr.Start(ctx, st.Step, trace.WithTimestamp(st.StartedAt), trace.WithAttributes(attribute.String("vllm_hi.model", st.Model)))
		if st.Error != "" {
			span.SetStatus(otelcodes.Error, st.Error)
		}
		span.End(trace.WithTimestamp(st.StartedAt.Add(stepDuration(st.DurationS))))
	}
	if rep.State != OutcomeSucceeded {
		root.SetStatus(otelcodes.Error, rep.Error)
	}
	root.End(trace.WithTimestamp(rep.StartedAt.Add(stepDuration(rep.DurationS))))
}

func stepDuration(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

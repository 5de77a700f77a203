package scale

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// traceOp records an ended scale operation as a span with a child per
// phase (Config.Tracer), from its status: the phases are timed as they
// ran, and written once the operation is over.
func (s *Scaler) traceOp(st hostapi.ScaleStatus) {
	t := s.cfg.Tracer
	if t == nil {
		return
	}
	end := st.FinishedAt
	if end.IsZero() {
		end = time.Now()
	}
	_, root := t.Start(context.Background(), "scale", trace.WithTimestamp(st.CreatedAt),
		trace.WithAttributes(attribute.String("vllm_hi.scale_id", st.ID), attribute.String("vllm_hi.kind", st.Kind),
			attribute.String("gen_ai.request.model", st.Model), attribute.Int("vllm_hi.from", st.From), attribute.Int("vllm_hi.to", st.To),
			attribute.String("vllm_hi.state", st.State), attribute.Float64("vllm_hi.downtime_s", st.DowntimeS)))
	ctx := trace.ContextWithSpan(context.Background(), root)
	for _, p := range st.Phases {
		_, span := t.Start(ctx, p.Phase, trace.WithTimestamp(p.StartedAt))
		if p.Instance != "" {
			span.SetAttributes(attribute.String("vllm_hi.instance", p.Instance))
		}
		span.End(trace.WithTimestamp(p.StartedAt.Add(time.Duration(p.DurationS * float64(time.Second)))))
	}
	if st.State != hostapi.StateSucceeded {
		root.SetStatus(otelcodes.Error, st.Error)
	}
	root.End(trace.WithTimestamp(end))
}

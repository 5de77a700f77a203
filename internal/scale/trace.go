package scale

import (
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/tracing"
)

// traceOp records an ended scale operation as a span with a child per
// phase (Config.Tracer), from its status: the phases are timed as they
// ran, and written once the operation is over.
func (s *Scaler) traceOp(st hostapi.ScaleStatus) {
	root := tracing.Operation("scale", st.CreatedAt, st.FinishedAt, st.State == hostapi.StateSucceeded, st.Error,
		attribute.String("vllm_hi.scale_id", st.ID), attribute.String("vllm_hi.kind", st.Kind),
		attribute.String("gen_ai.request.model", st.Model), attribute.Int("vllm_hi.from", st.From), attribute.Int("vllm_hi.to", st.To),
		attribute.String("vllm_hi.state", st.State), attribute.Float64("vllm_hi.downtime_s", st.DowntimeS))
	for _, p := range st.Phases {
		c := tracing.Span{Name: p.Phase, Start: p.StartedAt, End: p.StartedAt.Add(time.Duration(p.DurationS * float64(time.Second)))}
		if p.Instance != "" {
			c.Attributes = []attribute.KeyValue{attribute.String("vllm_hi.instance", p.Instance)}
		}
		root.Children = append(root.Children, c)
	}
	tracing.Record(s.cfg.Tracer, root)
}

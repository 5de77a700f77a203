package drain

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// traceDrain records an ended drain as a span (Config.Tracer), from its
// status: what it moved and finished, and the migrations it ran (each
// its own trace, named by id here).
func (o *Drainer) traceDrain(st hostapi.DrainStatus) {
	t := o.cfg.Tracer
	if t == nil {
		return
	}
	end := st.FinishedAt
	if end.IsZero() {
		end = time.Now()
	}
	_, span := t.Start(context.Background(), "drain", trace.WithTimestamp(st.CreatedAt),
		trace.WithAttributes(attribute.String("vllm_hi.drain_id", st.ID), attribute.String("vllm_hi.instance", st.Instance),
			attribute.String("vllm_hi.cause", st.Cause), attribute.String("vllm_hi.state", st.State), attribute.Int("vllm_hi.moved", st.Moved),
			attribute.Int("vllm_hi.finished_there", st.Finished), attribute.StringSlice("vllm_hi.migrations", st.Migration)))
	if st.State != hostapi.StateSucceeded {
		span.SetStatus(otelcodes.Error, st.Error)
	}
	span.End(trace.WithTimestamp(end))
}

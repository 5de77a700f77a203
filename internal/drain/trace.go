package drain

import (
	"go.opentelemetry.io/otel/attribute"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/tracing"
)

// traceDrain records an ended drain as a span (Config.Tracer), from its
// status: what it moved and finished, and the migrations it ran (each
// its own trace, named by id here).
func (o *Drainer) traceDrain(st hostapi.DrainStatus) {
	tracing.Record(o.cfg.Tracer, tracing.Operation("drain", st.CreatedAt, st.FinishedAt, st.State == hostapi.StateSucceeded, st.Error,
		attribute.String("vllm_hi.drain_id", st.ID), attribute.String("vllm_hi.instance", st.Instance),
		attribute.String("vllm_hi.cause", st.Cause), attribute.String("vllm_hi.state", st.State), attribute.Int("vllm_hi.moved", st.Moved),
		attribute.Int("vllm_hi.finished_there", st.Finished), attribute.StringSlice("vllm_hi.migrations", st.Migration)))
}

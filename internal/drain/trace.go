package drain

import (
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/tracing"
)

// traceDrain records an ended drain as a span (Config.Tracer), from its
// status: what it moved and finished, and the migrations it ran (each
// its own trace, named by id here).
func (o *Drainer) traceDrain(st hostapi.DrainStatus) {
	end := st.FinishedAt
	if end.IsZero() {
		end = time.Now()
	}
	s := tracing.Span{Name: "drain", Start: st.CreatedAt, End: end, Attributes: []attribute.KeyValue{
		attribute.String("vllm_hi.drain_id", st.ID), attribute.String("vllm_hi.instance", st.Instance),
		attribute.String("vllm_hi.cause", st.Cause), attribute.String("vllm_hi.state", st.State), attribute.Int("vllm_hi.moved", st.Moved),
		attribute.Int("vllm_hi.finished_there", st.Finished), attribute.StringSlice("vllm_hi.migrations", st.Migration)}}
	if st.State != hostapi.StateSucceeded {
		s.Err = st.Error
	}
	tracing.Record(o.cfg.Tracer, s)
}

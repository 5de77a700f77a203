package migrate

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// A migration's trace (Config.Tracer): one span for the migration, from
// its request to its end, and a child span per step, named as the
// status's step_history names it — what an operator's tracing backend
// shows beside the requests' spans.
type spans struct {
	root, step trace.Span
	ended      bool
}

// traceStep ends the step span in progress and starts s's, at at. The
// caller holds m.mu.
func (m *migration) traceStep(s step, at time.Time) {
	t := m.o.cfg.Tracer
	if t == nil || m.tr.ended {
		return
	}
	if m.tr.root == nil {
		_, m.tr.root = t.Start(context.Background(), "migration", trace.WithTimestamp(m.st.CreatedAt),
			trace.WithAttributes(attribute.String("vllm_hi.migration_id", m.st.ID), attribute.String("vllm_hi.src", m.st.Src),
				attribute.String("vllm_hi.dst", m.st.Dst), attribute.String("vllm_hi.migration_type", m.st.Type)))
	}
	if m.tr.step != nil {
		m.tr.step.End(trace.WithTimestamp(at))
	}
	_, m.tr.step = t.Start(trace.ContextWithSpan(context.Background(), m.tr.root), string(s), trace.WithTimestamp(at))
}

// traceEnd ends the migration's spans with its outcome. The caller holds
// m.mu.
func (m *migration) traceEnd(at time.Time) {
	if m.tr.root == nil || m.tr.ended {
		return
	}
	m.tr.ended = true
	if m.tr.step != nil {
		m.tr.step.End(trace.WithTimestamp(at))
	}
	st := &m.st
	m.tr.root.SetAttributes(attribute.String("vllm_hi.state", st.State), attribute.Int("vllm_hi.migrated_requests", st.Migrated),
		attribute.Float64("vllm_hi.downtime_s", st.DowntimeS), attribute.Float64("vllm_hi.client_downtime_s", st.ClientDowntimeS))
	if st.State != hostapi.StateSucceeded {
		m.tr.root.SetStatus(otelcodes.Error, st.Error)
	}
	m.tr.root.End(trace.WithTimestamp(at))
}

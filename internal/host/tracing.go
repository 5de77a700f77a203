package host

import (
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	otelcodes "go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/tracing"
)

// traced starts a relayed request's span — the child of the client's
// trace when its traceparent names one — and returns the request
// carrying it; the caller ends the span.
func (h *Host) traced(r *http.Request) (*http.Request, trace.Span) {
	ctx := tracing.Propagator.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
	ctx, span := h.tracer.Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
	return r.WithContext(ctx), span
}

// injectTrace writes the request's trace context into the engine's
// request: the engine's spans (vLLM's --otlp-traces-endpoint) are the
// Host's span's children. Without tracing it is the client's, as it came.
func injectTrace(r *http.Request, hdr http.Header) {
	if trace.SpanContextFromContext(r.Context()).IsValid() {
		tracing.Propagator.Inject(r.Context(), propagation.HeaderCarrier(hdr))
	}
}

// annotate records what became of a relayed request on its span.
func annotate(r *http.Request, rid, model, instance string, res proxy.Result) {
	span := trace.SpanFromContext(r.Context())
	if !span.IsRecording() {
		return
	}
	span.SetAttributes(attribute.String("vllm_hi.request_id", rid), attribute.String("gen_ai.request.model", model),
		attribute.String("vllm_hi.instance", instance), attribute.Int("http.response.status_code", res.Status),
		attribute.Int("vllm_hi.tokens", res.Tokens))
	if !res.FirstToken.IsZero() {
		span.AddEvent("first token", trace.WithTimestamp(res.FirstToken))
	}
	if res.Status >= 500 {
		span.SetStatus(otelcodes.Error, http.StatusText(res.Status))
	}
}

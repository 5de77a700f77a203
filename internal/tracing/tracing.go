// Package tracing sets up the OpenTelemetry traces the Host exports
// (--otlp-traces-endpoint): one span per relayed request, one per
// migration with a child span per step. Without an endpoint every tracer
// is a no-op and nothing is sent.
package tracing

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/vllm-hi/vllm-hi/internal/version"
)

// Propagator reads and writes W3C trace context (traceparent,
// tracestate): a client's trace goes on through the Host to the engine.
var Propagator = propagation.TraceContext{}

// Setup returns the tracer provider for service, exporting over
// OTLP/HTTP to endpoint (a collector's URL, e.g. http://otel:4318; its
// path defaults to /v1/traces), and its shutdown, which flushes what is
// batched. An empty endpoint gives a no-op provider.
func Setup(ctx context.Context, endpoint, service string) (trace.TracerProvider, func(context.Context) error, error) {
	if endpoint == "" {
		return noop.NewTracerProvider(), func(context.Context) error { return nil }, nil
	}
	u, err := url.Parse(endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, nil, fmt.Errorf("--otlp-traces-endpoint %q: want http(s)://HOST:PORT[/PATH]", endpoint)
	}
	if strings.Trim(u.Path, "/") == "" {
		u.Path = "/v1/traces"
	}
	exp, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(u.String()))
	if err != nil {
		return nil, nil, fmt.Errorf("--otlp-traces-endpoint: %w", err)
	}
	res := resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName(service), semconv.ServiceVersion(version.Version()))
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	return tp, tp.Shutdown, nil
}

// Span is an operation that already ran, as Record writes it: its name,
// when it began and ended, what it was, whether it failed, and the
// steps it ran.
type Span struct {
	Name       string
	Start, End time.Time
	Attributes []attribute.KeyValue
	Err        string // "": it succeeded
	Children   []Span
}

// Operation is the span of an operation from its status: it ends when
// the operation finished (now, while it runs) and carries errMsg unless
// it succeeded.
func Operation(name string, created, finished time.Time, succeeded bool, errMsg string, attrs ...attribute.KeyValue) Span {
	if finished.IsZero() {
		finished = time.Now()
	}
	s := Span{Name: name, Start: created, End: finished, Attributes: attrs}
	if !succeeded {
		s.Err = errMsg
	}
	return s
}

// Record writes s and its children as spans of t, timed as they ran: the
// drains, scale operations and switches, whose steps are known once
// each ended, are traced so. Nothing without a tracer.
func Record(t trace.Tracer, s Span) {
	if t != nil {
		record(context.Background(), t, s)
	}
}

func record(ctx context.Context, t trace.Tracer, s Span) {
	ctx, span := t.Start(ctx, s.Name, trace.WithTimestamp(s.Start), trace.WithAttributes(s.Attributes...))
	for _, c := range s.Children {
		record(ctx, t, c)
	}
	if s.Err != "" {
		span.SetStatus(codes.Error, s.Err)
	}
	span.End(trace.WithTimestamp(s.End))
}

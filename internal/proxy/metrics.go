package proxy

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the proxy's instruments, named vhi_*; the Host registers
// them (Collectors).
type Metrics struct {
	AddedLatency    prometheus.Histogram   // upstream event read → client write flushed
	UpstreamErrors  *prometheus.CounterVec // labels: model, kind
	StreamsInFlight prometheus.Gauge
	StreamTokens    prometheus.Counter // token events forwarded
	Rerouted        prometheus.Counter // requests sent to another engine because theirs was unreachable
	Held            prometheus.Counter // requests held through an engine's 503 (an elastic-EP commit) and sent again
	// LoopStreams counts streams the event loop took, by how they left it
	// (outcome: done, client_closed, handed_back).
	LoopStreams *prometheus.CounterVec
}

// Outcomes of a stream on the event loop (Metrics.LoopStreams).
const (
	LoopDone         = "done"          // relayed to its [DONE] on the loop
	LoopClientClosed = "client_closed" // its client went away
	LoopHandedBack   = "handed_back"   // the goroutine relay went on with it (a migration, a failover, a slow client)
)

// NewMetrics makes the proxy's instruments.
func NewMetrics() *Metrics {
	return &Metrics{
		AddedLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vhi_proxy_added_latency_seconds", Help: "Time from reading an SSE event from the engine to flushing it to the client.",
			Buckets: []float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1},
		}),
		UpstreamErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_upstream_errors_total", Help: "Engine failures seen by the proxy, by model and kind (connect, read, eof_without_done).",
		}, []string{"model", "kind"}),
		StreamsInFlight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "vhi_streams_in_flight", Help: "Client SSE streams being relayed now.",
		}),
		StreamTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_stream_tokens_total", Help: "Token events relayed to clients.",
		}),
		Rerouted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_requests_rerouted_total", Help: "Requests sent to another instance because the engine chosen first could not be reached.",
		}),
		Held: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_requests_held_total", Help: "Requests held through an engine's 503 while it scaled (elastic EP commit) and sent again, instead of failing.",
		}),
		LoopStreams: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_proxy_event_loop_streams_total", Help: "Streams the relay's event loop took (--relay-event-loop), by how they left it: done, client_closed, handed_back (to the goroutine relay: a migration, a failover, a slow client).",
		}, []string{"outcome"}),
	}
}

// Collectors lists the instruments for registration.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.AddedLatency, m.UpstreamErrors, m.StreamsInFlight, m.StreamTokens, m.Rerouted, m.Held, m.LoopStreams}
}

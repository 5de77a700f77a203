package host

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// metrics are the Host's own instruments, all prefixed vhi_.
type metrics struct {
	requests      *prometheus.CounterVec
	heartbeats    *prometheus.CounterVec
	registrations *prometheus.CounterVec
	proxy         *proxy.Metrics
	migrations    *migrate.Metrics
}

func newMetrics(reg prometheus.Registerer, instances *registry.Registry) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_requests_total", Help: "OpenAI requests the Host answered, by served model name and HTTP status (499: the client left first).",
		}, []string{"model", "code"}),
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_agent_heartbeats_total", Help: "Agent heartbeats received, by result (ok, unknown: the agent must re-register).",
		}, []string{"result"}),
		registrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_agent_registrations_total", Help: "Agent registrations, by result (ok, invalid, conflict, unauthenticated).",
		}, []string{"result"}),
		proxy: &proxy.Metrics{
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
		},
		migrations: migrate.NewMetrics(),
	}
	instancesByState := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "vhi_instances", Help: "Registered instances by state.",
	}, []string{"state"})
	reg.MustRegister(m.requests, m.heartbeats, m.registrations,
		m.proxy.AddedLatency.(prometheus.Collector), m.proxy.UpstreamErrors, m.proxy.StreamsInFlight, m.proxy.StreamTokens,
		&stateCollector{vec: instancesByState, reg: instances})
	reg.MustRegister(m.migrations.Collectors()...)
	return m
}

// stateCollector reads instance counts from the registry at scrape time.
type stateCollector struct {
	vec *prometheus.GaugeVec
	reg *registry.Registry
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) { c.vec.Describe(ch) }

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	counts := c.reg.CountByState()
	for _, s := range []registry.State{registry.StateActive, registry.StateStandby, registry.StateMigrating, registry.StateDraining, registry.StateUnreachable} {
		c.vec.WithLabelValues(string(s)).Set(float64(counts[s]))
	}
	c.vec.Collect(ch)
}

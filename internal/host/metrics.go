package host

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/vllm-hi/vllm-hi/internal/autoscale"
	"github.com/vllm-hi/vllm-hi/internal/drain"
	"github.com/vllm-hi/vllm-hi/internal/failover"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/rebalance"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/scale"
)

// metrics are the Host's own instruments, all prefixed vhi_.
type metrics struct {
	requests      *prometheus.CounterVec
	heartbeats    *prometheus.CounterVec
	registrations *prometheus.CounterVec
	proxy         *proxy.Metrics
	migrations    *migrate.Metrics
	drains        *drain.Metrics
	rebalance     *prometheus.CounterVec
	scales        *prometheus.CounterVec
	failover      *failover.Metrics
	autoscale     *autoscale.Metrics
	ttft          *prometheus.HistogramVec
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
		proxy:      proxy.NewMetrics(),
		migrations: migrate.NewMetrics(),
		drains:     drain.NewMetrics(),
		rebalance:  rebalance.NewMetric(),
		scales:     scale.NewMetric(),
		failover:   failover.NewMetrics(),
		autoscale:  autoscale.NewMetrics(),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vhi_time_to_first_token_seconds", Help: "Time from a request's arrival at the Host to its first token sent to the client (a non-streamed answer: its head), by model; holds and switches included.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80},
		}, []string{"model"}),
	}
	instancesByState := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "vhi_instances", Help: "Registered instances by state.",
	}, []string{"state"})
	reg.MustRegister(m.requests, m.heartbeats, m.registrations, m.rebalance, m.scales, &stateCollector{vec: instancesByState, reg: instances})
	reg.MustRegister(m.proxy.Collectors()...)
	reg.MustRegister(m.migrations.Collectors()...)
	reg.MustRegister(m.drains.Collectors()...)
	reg.MustRegister(m.failover.Collectors()...)
	reg.MustRegister(m.autoscale.Collectors()...)
	reg.MustRegister(m.ttft)
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

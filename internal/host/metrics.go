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
	"github.com/vllm-hi/vllm-hi/internal/version"
)

// metrics are the Host's own instruments, all prefixed vhi_.
type metrics struct {
	requests      *prometheus.CounterVec
	heartbeats    *prometheus.CounterVec
	registrations *prometheus.CounterVec
	// hostSwitches counts this Host's streams switched by migrations that
	// another Host of a shared store ran.
	hostSwitches *prometheus.CounterVec
	leader       prometheus.Gauge // 1 while this Host decides
	// storeRejoins counts the new leases this Host took on its shared
	// store after its last one ended while it followed.
	storeRejoins prometheus.Counter
	proxy        *proxy.Metrics
	migrations   *migrate.Metrics
	drains       *drain.Metrics
	rebalance    *prometheus.CounterVec
	scales       *prometheus.CounterVec
	failover     *failover.Metrics
	autoscale    *autoscale.Metrics
	ttft         *prometheus.HistogramVec
	duration     *prometheus.HistogramVec
	tpot         *prometheus.HistogramVec
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
		hostSwitches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_host_switched_streams_total", Help: "Streams this Host relays that a migration another Host of the shared store ran switched, by outcome (switched, failed).",
		}, []string{"outcome"}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "vhi_host_leader", Help: "1 while this Host decides (it leads its shared store and took it over, or has none to share), else 0.",
		}),
		storeRejoins: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_host_store_rejoins_total", Help: "New leases this Host took on its shared store after its last one ended while it followed (etcd stalled or out of reach past the lease).",
		}),
		proxy:      proxy.NewMetrics(),
		migrations: migrate.NewMetrics(),
		drains:     drain.NewMetrics(),
		rebalance:  rebalance.NewMetric(),
		scales:     scale.NewMetric(),
		failover:   failover.NewMetrics(),
		autoscale:  autoscale.NewMetrics(),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vhi_request_duration_seconds", Help: "Time from a request's arrival at the Host to the end of its answer (a stream's last event), by model.",
			Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320},
		}, []string{"model"}),
		tpot: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vhi_time_per_output_token_seconds", Help: "A stream's mean time between tokens as its client got them (last token - first token, over tokens - 1), by model.",
			Buckets: []float64{0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1},
		}, []string{"model"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vhi_time_to_first_token_seconds", Help: "Time from a request's arrival at the Host to its first token sent to the client (a non-streamed answer: its head), by model; holds and switches included.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80},
		}, []string{"model"}),
	}
	instancesByState := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "vhi_instances", Help: "Registered instances by state.",
	}, []string{"state"})
	reg.MustRegister(m.requests, m.heartbeats, m.registrations, m.hostSwitches, m.leader, m.storeRejoins, m.rebalance, m.scales, &stateCollector{vec: instancesByState, reg: instances})
	reg.MustRegister(m.proxy.Collectors()...)
	reg.MustRegister(m.migrations.Collectors()...)
	reg.MustRegister(m.drains.Collectors()...)
	reg.MustRegister(m.failover.Collectors()...)
	reg.MustRegister(m.autoscale.Collectors()...)
	reg.MustRegister(m.ttft, m.duration, m.tpot, &instanceCollector{reg: instances}, buildInfo())
	return m
}

// buildInfo is vhi_build_info: 1, labelled with what was built.
func buildInfo() prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "vhi_build_info", Help: "The Host's build: 1, labelled with its version, commit and Go version.",
	}, []string{"version", "commit", "go_version"})
	g.WithLabelValues(version.Version(), version.Commit(), version.GoVersion()).Set(1)
	return g
}

// instanceCollector exports each instance's load as its agent last
// reported it, read from the registry at scrape time: what an operator
// reads per engine beside the engines' own metrics.
type instanceCollector struct{ reg *registry.Registry }

var (
	descKV = prometheus.NewDesc("vhi_instance_kv_usage_ratio",
		"The share of an instance's KV blocks in use (its agent's last report), by instance and served model.", []string{"instance", "model"}, nil)
	descRunning = prometheus.NewDesc("vhi_instance_requests_running",
		"Requests running on an instance (its agent's last report), by instance and served model.", []string{"instance", "model"}, nil)
	descWaiting = prometheus.NewDesc("vhi_instance_requests_waiting",
		"Requests waiting on an instance (its agent's last report), by instance and served model.", []string{"instance", "model"}, nil)
	descUp = prometheus.NewDesc("vhi_instance_up",
		"1 while the Host routes to an instance (active, reachable, healthy, awake, not retired), else 0, by instance and served model.", []string{"instance", "model"}, nil)
)

func (c *instanceCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descKV
	ch <- descRunning
	ch <- descWaiting
	ch <- descUp
}

func (c *instanceCollector) Collect(ch chan<- prometheus.Metric) {
	for _, i := range c.reg.List() {
		model := ""
		if len(i.Engine.ServedModels) > 0 {
			model = i.Engine.ServedModels[0]
		}
		st := i.Stats
		kv := 0.0
		if st.TotalBlocks > 0 {
			kv = float64(st.TotalBlocks-st.FreeBlocks) / float64(st.TotalBlocks)
		}
		up := 0.0
		if i.EffectiveState() == registry.StateActive && st.Healthy && !st.Sleeping && !i.Retired {
			up = 1
		}
		ch <- prometheus.MustNewConstMetric(descKV, prometheus.GaugeValue, kv, i.ID, model)
		ch <- prometheus.MustNewConstMetric(descRunning, prometheus.GaugeValue, float64(st.Running), i.ID, model)
		ch <- prometheus.MustNewConstMetric(descWaiting, prometheus.GaugeValue, float64(st.Waiting), i.ID, model)
		ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, up, i.ID, model)
	}
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

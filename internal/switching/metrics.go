package switching

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the switching metrics (vhi_switch*).
type Metrics struct {
	switches *prometheus.CounterVec
	seconds  *prometheus.HistogramVec
	queued   *prometheus.GaugeVec
	state    *prometheus.GaugeVec
	s        *Switcher
}

// NewMetrics makes the metrics; Collectors registers them.
func NewMetrics() *Metrics {
	return &Metrics{
		switches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_switches_total", Help: "Model switches (drain, sleep, wake, checks), by the model woken and outcome.",
		}, []string{"model", "outcome"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "vhi_switch_seconds", Help: "Duration of a model switch, end to end.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120},
		}, []string{"model"}),
		queued: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vhi_switch_queued_requests", Help: "Requests waiting for their model to be woken.",
		}, []string{"model"}),
		state: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "vhi_switch_model_state", Help: "A switched model's state: 1 for the state it is in.",
		}, []string{"model", "state"}),
	}
}

// Collectors are the metrics to register.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.switches, m.seconds, m.queued, stateCollector{m}}
}

// observe ties the state gauge to s.
func (m *Metrics) observe(s *Switcher) { m.s = s }

// stateCollector reads the states when scraped.
type stateCollector struct{ m *Metrics }

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) { c.m.state.Describe(ch) }

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	if c.m.s != nil {
		for alias, st := range c.m.s.State() {
			for _, name := range []string{StateUnknown, StateAwake, StateSleeping, StateWaking, StateSleepingInProgress, StateError} {
				v := 0.0
				if st.State == name {
					v = 1
				}
				c.m.state.WithLabelValues(alias, name).Set(v)
			}
		}
	}
	c.m.state.Collect(ch)
}

// forget drops the series of a model a reload let go (its switch counts
// and durations stay: they happened).
func (m *Metrics) forget(alias string) {
	m.queued.DeleteLabelValues(alias)
	m.state.DeletePartialMatch(prometheus.Labels{"model": alias})
}

package drain

import "github.com/prometheus/client_golang/prometheus"

// Metrics are the drains' instruments; the Host registers them. A nil
// *Metrics records nothing.
type Metrics struct {
	// Drains counts drains by how they ended: succeeded (the instance
	// emptied and retired), failed, or refused (nothing changed).
	Drains *prometheus.CounterVec
}

// NewMetrics makes the drains' instruments.
func NewMetrics() *Metrics {
	return &Metrics{
		Drains: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_drains_total", Help: "Drains by outcome (succeeded: every request moved or finished and the instance retired, failed, refused: nothing changed).",
		}, []string{"state"}),
	}
}

// Collectors lists the instruments for registration.
func (m *Metrics) Collectors() []prometheus.Collector { return []prometheus.Collector{m.Drains} }

// ended counts a drain by its outcome (refused: answered 4xx).
func (m *Metrics) ended(state string) {
	if m != nil {
		m.Drains.WithLabelValues(state).Inc()
	}
}

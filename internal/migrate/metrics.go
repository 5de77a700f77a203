package migrate

import (
	"errors"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the orchestrator's instruments; the Host registers them. A
// nil *Metrics records nothing.
type Metrics struct {
	// Migrations counts migrations by how they ended: succeeded, aborted
	// (rolled back), failed, or refused (answered 4xx, nothing started).
	Migrations *prometheus.CounterVec
	// Downtime is each successful migration's downtime_s; ClientDowntime
	// its client_downtime_s; Duration the whole migration, request to done.
	Downtime, ClientDowntime, Duration prometheus.Histogram
	// Bytes is the KV moved over all rounds; Requests the requests that
	// moved.
	Bytes, Requests prometheus.Counter
	// IntegrityFailures counts migrations aborted because the target did
	// not hold what the source held.
	IntegrityFailures prometheus.Counter
}

// NewMetrics makes the orchestrator's instruments, named vhi_migration*.
func NewMetrics() *Metrics {
	pause := []float64{0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5}
	return &Metrics{
		Migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_migrations_total", Help: "Migrations by outcome (succeeded, aborted: rolled back, failed, refused: nothing started).",
		}, []string{"state"}),
		Downtime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vhi_migration_downtime_seconds", Help: "Successful migrations' downtime: the moved requests' stop on the source (a step boundary) to the target's commit.",
			Buckets: pause,
		}),
		ClientDowntime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vhi_migration_client_downtime_seconds", Help: "Successful migrations' longest gap a moved stream's client saw across the switch (last token from the source to first from the target).",
			Buckets: pause,
		}),
		Duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vhi_migration_duration_seconds", Help: "Migrations from the request to the end, whatever the outcome.",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300},
		}),
		Bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_migration_bytes_total", Help: "KV bytes copied by migration rounds.",
		}),
		Requests: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_migrated_requests_total", Help: "Requests that moved to another instance.",
		}),
		IntegrityFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_migration_integrity_failures_total", Help: "Migrations rolled back because the target did not hold what the source held (the check before the commit).",
		}),
	}
}

// Collectors lists the instruments for registration.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.Migrations, m.Downtime, m.ClientDowntime, m.Duration, m.Bytes, m.Requests, m.IntegrityFailures}
}

// integrity counts a migration that a check before its commit stopped
// because the KV differed (not one whose check could not be made).
func (m *Metrics) integrity(err error) {
	if m != nil && errors.Is(err, errdefs.ErrDataLoss) {
		m.IntegrityFailures.Inc()
	}
}

// Refused counts a migrate request answered with a 4xx (nothing started).
func (m *Metrics) Refused() {
	if m != nil {
		m.Migrations.WithLabelValues("refused").Inc()
	}
}

// ended records a migration that ran.
func (m *Metrics) ended(st hostapi.MigrationStatus) {
	if m == nil {
		return
	}
	m.Migrations.WithLabelValues(st.State).Inc()
	m.Duration.Observe(st.FinishedAt.Sub(st.CreatedAt).Seconds())
	var bytes int64
	for _, r := range st.Rounds {
		bytes += r.Bytes
	}
	m.Bytes.Add(float64(bytes))
	if st.State == hostapi.StateSucceeded {
		m.Downtime.Observe(st.DowntimeS)
		m.ClientDowntime.Observe(st.ClientDowntimeS)
		m.Requests.Add(float64(st.Migrated))
	}
}

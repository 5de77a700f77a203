package migrate

import (
	"time"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// What round 0 costs the source's clients: it copies every moving
// request's KV while the source decodes, and where copy and decode share
// the machine (tcp_shm's copies on the CPU) the clients wait longer
// between tokens. The Host sees every token of the streams it relays, so
// the migration reports their inter-token gaps (p99) while round 0 ran
// against a window just before it (issue 35), paced or not.

// gapsBefore is the window before round 0 its gaps are compared with.
const gapsBefore = time.Second

// movingGaps are the gaps of the moving streams this Host relays that
// ended in [from, to).
func (m *migration) movingGaps(from, to time.Time) []time.Duration {
	m.mu.Lock()
	ids := make([]string, 0, len(m.moving))
	for id := range m.moving {
		ids = append(ids, id)
	}
	m.mu.Unlock()
	var gaps []time.Duration
	for _, id := range ids {
		if s := m.o.streams.Get(id); s != nil {
			gaps = s.TokenGaps(from, to, gaps)
		}
	}
	return gaps
}

// noteRound0Gaps records on round 0's status the clients' p99 gap while
// it ran (from start to now) and in the second before it (before, read
// when it started).
func (m *migration) noteRound0Gaps(start time.Time, before time.Duration) {
	during := proxy.P99(m.movingGaps(start, time.Now()))
	m.mu.Lock()
	defer m.mu.Unlock()
	if n := len(m.st.Rounds); n > 0 { // round 0, which copyRound just recorded
		r := &m.st.Rounds[n-1]
		r.SourceGapP99BeforeS, r.SourceGapP99S = before.Seconds(), during.Seconds()
	}
}

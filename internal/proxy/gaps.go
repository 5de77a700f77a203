package proxy

import (
	"slices"
	"time"
)

// tokenTimes keeps when a stream's last token events were read from its
// engine, so that a migration can say what its round 0 cost the source's
// clients: their inter-token gaps while it copied, against just before
// (issue 35). A fixed ring of Unix nanoseconds (2 KiB a stream): no
// allocation per event.
type tokenTimes struct {
	at   [tokenTimesKept]int64
	next int // where the next time goes
	n    int // how many are kept
}

// tokenTimesKept covers an unpaced round 0 and the seconds before it at
// a decode step of ~10 ms; of a longer (paced) round 0, its last tokens.
const tokenTimesKept = 256

func (t *tokenTimes) add(at time.Time) {
	t.at[t.next] = at.UnixNano()
	t.next = (t.next + 1) % tokenTimesKept
	t.n = min(t.n+1, tokenTimesKept)
}

// gaps appends to dst the gaps between consecutive kept times whose later
// end falls in [from, to).
func (t *tokenTimes) gaps(from, to time.Time, dst []time.Duration) []time.Duration {
	first := (t.next - t.n + tokenTimesKept) % tokenTimesKept
	lo, hi := from.UnixNano(), to.UnixNano()
	for i := 1; i < t.n; i++ {
		prev, cur := t.at[(first+i-1)%tokenTimesKept], t.at[(first+i)%tokenTimesKept]
		if cur >= lo && cur < hi {
			dst = append(dst, time.Duration(cur-prev))
		}
	}
	return dst
}

// TokenGaps appends to dst the stream's inter-token gaps (as the relay
// read its token events) that ended in [from, to), among its last few
// hundred tokens.
func (s *Stream) TokenGaps(from, to time.Time, dst []time.Duration) []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.times.gaps(from, to, dst)
}

// P99 is the 99th percentile of gaps (0 for none); it sorts gaps.
func P99(gaps []time.Duration) time.Duration {
	if len(gaps) == 0 {
		return 0
	}
	slices.Sort(gaps)
	return gaps[min(len(gaps)-1, len(gaps)*99/100)]
}

// Package slo keeps the Host's rolling view of time to first token per
// model: every request's TTFT as the Host saw it (from its arrival to the
// first token relayed to the client, holds and switches included), a
// failed one as a penalty, over a sliding window — the signal the
// autoscaler holds to an SLO (the Elastic EP seed's rolling p95 TTFT,
// failed requests counted as 30 s).
package slo

import (
	"sort"
	"sync"
	"time"
)

// maxSamples bounds what one model keeps (the oldest go first): at 1,000
// requests a second a 30 s window needs 30,000.
const maxSamples = 1 << 16

type sample struct {
	at  time.Time
	val float64 // seconds
}

// Window holds the samples of the last Span, per model.
type Window struct {
	span    time.Duration
	penalty time.Duration

	mu     sync.Mutex
	models map[string][]sample
}

// New keeps span of samples; a failed request counts as penalty.
func New(span, penalty time.Duration) *Window {
	return &Window{span: span, penalty: penalty, models: map[string][]sample{}}
}

// Span is how far back the window reaches.
func (w *Window) Span() time.Duration { return w.span }

// Observe records one request's TTFT.
func (w *Window) Observe(model string, at time.Time, ttft time.Duration) {
	w.add(model, sample{at, ttft.Seconds()})
}

// Fail records a request that failed (the Host or the engine answered it
// with an error, or its stream broke before its first token).
func (w *Window) Fail(model string, at time.Time) {
	w.add(model, sample{at, w.penalty.Seconds()})
}

func (w *Window) add(model string, s sample) {
	w.mu.Lock()
	defer w.mu.Unlock()
	l := append(w.models[model], s)
	if len(l) > maxSamples {
		l = l[len(l)-maxSamples:]
	}
	w.models[model] = l
}

// Quantile is the q-quantile (0 < q ≤ 1) of model's samples taken within
// span before now (at most the window's span), and how many there were.
func (w *Window) Quantile(model string, now time.Time, span time.Duration, q float64) (seconds float64, n int) {
	if span <= 0 || span > w.span {
		span = w.span
	}
	w.mu.Lock()
	l := w.models[model]
	// Samples arrive in about time order: drop those older than the
	// window, then take the ones within span.
	cut := sort.Search(len(l), func(i int) bool { return !l[i].at.Before(now.Add(-w.span)) })
	l = l[cut:]
	w.models[model] = l
	from := sort.Search(len(l), func(i int) bool { return !l[i].at.Before(now.Add(-span)) })
	vals := make([]float64, 0, len(l)-from)
	for _, s := range l[from:] {
		vals = append(vals, s.val)
	}
	w.mu.Unlock()
	if len(vals) == 0 {
		return 0, 0
	}
	sort.Float64s(vals)
	i := int(q*float64(len(vals))+0.999999) - 1 // nearest rank
	return vals[min(max(i, 0), len(vals)-1)], len(vals)
}

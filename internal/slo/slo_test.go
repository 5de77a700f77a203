package slo

import (
	"testing"
	"time"
)

func TestRollingQuantile(t *testing.T) {
	w := New(10*time.Second, 30*time.Second)
	t0 := time.Unix(1000, 0)
	for i := range 100 {
		w.Observe("m", t0.Add(time.Duration(i)*100*time.Millisecond), time.Duration(i+1)*time.Millisecond)
	}
	now := t0.Add(10 * time.Second)
	if p, n := w.Quantile("m", now, 0, 0.95); n != 100 || p != 0.095 {
		t.Fatalf("p95 of 1..100 ms: %v over %d", p, n)
	}
	// The last second only: 91..100 ms.
	if p, n := w.Quantile("m", now, time.Second, 0.5); n != 10 || p != 0.095 {
		t.Fatalf("median of the last second: %v over %d", p, n)
	}
	// A failure counts as the penalty.
	w.Fail("m", now)
	if p, _ := w.Quantile("m", now, time.Second, 1); p != 30 {
		t.Fatalf("max with a failure: %v", p)
	}
	// Samples age out of the window; other models are apart.
	if _, n := w.Quantile("m", now.Add(20*time.Second), 0, 0.95); n != 0 {
		t.Fatalf("%d samples left after the window", n)
	}
	if _, n := w.Quantile("other", now, 0, 0.95); n != 0 {
		t.Fatalf("another model has %d samples", n)
	}
}

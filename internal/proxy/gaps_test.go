package proxy

import (
	"testing"
	"time"
)

func TestTokenGapsInAWindow(t *testing.T) {
	var tt tokenTimes
	t0 := time.Unix(1700000000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	for _, ms := range []int{0, 10, 20, 30, 130, 140, 150} {
		tt.add(at(ms))
	}
	got := tt.gaps(at(25), at(141), nil)
	want := []time.Duration{10 * time.Millisecond, 100 * time.Millisecond, 10 * time.Millisecond}
	if len(got) != len(want) {
		t.Fatalf("gaps %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("gaps %v, want %v", got, want)
		}
	}
	// The ring keeps the last tokenTimesKept: older gaps are gone.
	for i := 0; i < tokenTimesKept; i++ {
		tt.add(at(1000 + i))
	}
	if g := tt.gaps(at(0), at(999), nil); len(g) != 0 {
		t.Fatalf("gaps of overwritten times: %v", g)
	}
	if g := tt.gaps(at(0), at(5000), nil); len(g) != tokenTimesKept-1 {
		t.Fatalf("%d gaps among %d kept times", len(g), tokenTimesKept)
	}
	if p := P99([]time.Duration{5, 1, 3, 100}); p != 100 {
		t.Fatalf("p99 %v", p)
	}
	if p := P99(nil); p != 0 {
		t.Fatalf("p99 of nothing %v", p)
	}
}

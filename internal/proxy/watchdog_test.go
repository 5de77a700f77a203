package proxy

import (
	"testing"
	"time"
)

func TestIdleWatchdogWaitsForSilence(t *testing.T) {
	fired := make(chan time.Time, 1)
	start := time.Now()
	w := newIdleWatchdog(100*time.Millisecond, func() { fired <- time.Now() })
	defer w.stop()
	// Events for three timeouts' worth: it must not fire meanwhile.
	for time.Since(start) < 300*time.Millisecond {
		w.saw(time.Now())
		select {
		case <-fired:
			t.Fatal("the watchdog fired while events kept arriving")
		case <-time.After(20 * time.Millisecond):
		}
	}
	last := time.Now()
	w.saw(last)
	select {
	case at := <-fired:
		if at.Sub(last) < 100*time.Millisecond {
			t.Fatalf("fired %v after the last event, before the 100ms timeout", at.Sub(last))
		}
		if !w.fired() {
			t.Fatal("fired() is false after it fired")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the watchdog never fired after the events stopped")
	}
}

func TestIdleWatchdogStopped(t *testing.T) {
	fired := make(chan struct{}, 1)
	w := newIdleWatchdog(30*time.Millisecond, func() { fired <- struct{}{} })
	w.stop()
	select {
	case <-fired:
		t.Fatal("a stopped watchdog fired")
	case <-time.After(150 * time.Millisecond):
	}
}

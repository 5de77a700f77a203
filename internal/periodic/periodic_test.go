package periodic

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// Do calls fn each interval and returns once ctx ends, with no call after.
func TestDoCallsUntilTheContextEnds(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var calls atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		Do(ctx, time.Millisecond, func() {
			if calls.Add(1) == 3 {
				cancel()
			}
		})
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Do did not return after its context ended")
	}
	if n := calls.Load(); n != 3 {
		t.Fatalf("%d calls, want 3 (none after the context ended)", n)
	}
}

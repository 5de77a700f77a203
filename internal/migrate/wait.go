package migrate

import (
	"context"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// ended is closed, and replaced, each time a migration ends: what Wait
// sleeps on (the orchestrator's users waited by polling each status every
// 20 ms).
type ended struct{ ch chan struct{} }

func newEnded() *ended { return &ended{ch: make(chan struct{})} }

// signalEnd wakes every waiter; they look at their status again.
func (o *Orchestrator) signalEnd() {
	o.mu.Lock()
	o.signalEndLocked()
	o.mu.Unlock()
}

func (o *Orchestrator) signalEndLocked() {
	close(o.ends.ch)
	o.ends.ch = make(chan struct{})
}

// next is the channel the next end closes.
func (o *Orchestrator) next() <-chan struct{} {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.ends.ch
}

// Wait returns migration id's status once it ended, or when ctx ends
// first (its status then, not ended). ok is false when the Host does not
// know the id (or no longer keeps it).
func (o *Orchestrator) Wait(ctx context.Context, id string) (hostapi.MigrationStatus, bool) {
	return waitFor(ctx, o, o.Get, id)
}

func waitFor[S interface{ Ended() bool }](ctx context.Context, o *Orchestrator, get func(string) (S, bool), id string) (S, bool) {
	for {
		// Taken before the status is read: an end between the two still
		// wakes this waiter.
		ch := o.next()
		st, ok := get(id)
		if !ok || st.Ended() {
			return st, ok
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return st, ok
		}
	}
}

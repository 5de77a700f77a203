package ends

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

type fakeStatus struct{ ended bool }

func (s fakeStatus) Ended() bool { return s.ended }

// A waiter wakes when an end is signalled, not by polling: an end
// signalled between its read of the status and its sleep still wakes it;
// a context that ends first returns the status not ended; an unknown id
// returns at once.
func TestWaitWakesAtTheEnd(t *testing.T) {
	var s Signal
	var ended, reads atomic.Int32
	get := func(id string) (fakeStatus, bool) {
		reads.Add(1)
		if id == "gone" {
			return fakeStatus{}, false
		}
		return fakeStatus{ended: ended.Load() == 1}, true
	}
	go func() {
		time.Sleep(50 * time.Millisecond)
		s.Ended() // another operation's end: the waiter looks again and sleeps on
		time.Sleep(50 * time.Millisecond)
		ended.Store(1)
		s.Ended()
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, ok := Wait(ctx, &s, get, "mig-1")
	if !ok || !st.Ended() {
		t.Fatalf("wait returned %+v %v before the end", st, ok)
	}
	if n := reads.Load(); n != 3 {
		t.Fatalf("the status was read %d times, want 3 (once at the start, once per end signalled)", n)
	}
	if _, ok := Wait(ctx, &s, get, "gone"); ok {
		t.Fatal("an unknown id was found")
	}
	ended.Store(0)
	short, cancelShort := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancelShort()
	if st, ok := Wait(short, &s, get, "mig-2"); !ok || st.Ended() {
		t.Fatalf("a wait whose context ended: %+v %v", st, ok)
	}
}

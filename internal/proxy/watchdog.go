package proxy

import (
	"sync"
	"sync/atomic"
	"time"
)

// idleWatchdog cuts an upstream that sent nothing for a while. The relay
// tells it of every event it reads; rather than moving a runtime timer
// for each of them (a timer-heap update per event, at tens of thousands
// of events a second), the timer fires on its original schedule and
// re-arms itself for what is left of the window since the last event.
type idleWatchdog struct {
	timeout time.Duration
	last    atomic.Int64 // UnixNano of the last event read
	idle    atomic.Bool
	onIdle  func()

	mu    sync.Mutex
	timer *time.Timer
}

func newIdleWatchdog(timeout time.Duration, onIdle func()) *idleWatchdog {
	w := &idleWatchdog{timeout: timeout, onIdle: onIdle}
	w.last.Store(time.Now().UnixNano())
	w.mu.Lock()
	w.timer = time.AfterFunc(timeout, w.check)
	w.mu.Unlock()
	return w
}

// saw records an event read at t.
func (w *idleWatchdog) saw(t time.Time) { w.last.Store(t.UnixNano()) }

// fired reports whether the upstream was cut for being idle.
func (w *idleWatchdog) fired() bool { return w.idle.Load() }

func (w *idleWatchdog) check() {
	left := w.timeout - time.Since(time.Unix(0, w.last.Load()))
	if left > 0 {
		w.mu.Lock()
		if w.timer != nil {
			w.timer.Reset(left)
		}
		w.mu.Unlock()
		return
	}
	w.idle.Store(true)
	w.onIdle()
}

// stop ends the watchdog (again: a no-op).
func (w *idleWatchdog) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
}

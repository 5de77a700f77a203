// Package ends lets callers wait for an operation (a migration, a drain)
// to end without polling its status: every end wakes every waiter, which
// reads its own operation's status again.
package ends

import (
	"context"
	"sync"
)

// Signal is closed, and replaced, at each end.
type Signal struct {
	mu sync.Mutex
	ch chan struct{}
}

// Ended wakes every waiter.
func (s *Signal) Ended() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil {
		close(s.ch)
	}
	s.ch = make(chan struct{})
}

// next is the channel the next end closes.
func (s *Signal) next() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch == nil {
		s.ch = make(chan struct{})
	}
	return s.ch
}

// Wait returns the status of operation id (get reads it) once it ended,
// or when ctx ends first (its status then, not ended). ok is false for an
// id get does not know.
func Wait[S interface{ Ended() bool }](ctx context.Context, s *Signal, get func(string) (S, bool), id string) (S, bool) {
	for {
		// Taken before the status is read: an end between the two still
		// wakes this waiter.
		ch := s.next()
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

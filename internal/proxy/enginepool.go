package proxy

import (
	"sync"
	"time"
)

// enginePool keeps the engine connections of streams the event loop
// relayed to their end, for the next stream to the same engine, as
// nginx's upstream keepalive does: no connection set up per stream on
// either side (an engine's API server pays for each one too). A
// connection goes in only when its answer ended exactly (the last chunk
// read, nothing after it), and out only while its engine keeps it
// (younger than engine.IdleConnTimeout, and nothing to read on it: an
// engine that closed it makes it readable).
type enginePool struct {
	mu      sync.Mutex
	idle    map[string][]idleEngineConn // by the engine's host:port
	maxIdle int                         // per engine
	maxAge  time.Duration
}

type idleEngineConn struct {
	fd    int
	since time.Time
}

func newEnginePool(maxIdle int, maxAge time.Duration) *enginePool {
	return &enginePool{idle: map[string][]idleEngineConn{}, maxIdle: maxIdle, maxAge: maxAge}
}

// put keeps fd for addr; false: the pool is full (the caller closes fd).
func (ep *enginePool) put(addr string, fd int) bool {
	ep.mu.Lock()
	defer ep.mu.Unlock()
	if len(ep.idle[addr]) >= ep.maxIdle {
		return false
	}
	ep.idle[addr] = append(ep.idle[addr], idleEngineConn{fd: fd, since: time.Now()})
	return true
}

// get takes the newest connection to addr its engine still keeps.
func (ep *enginePool) get(addr string) (int, bool) {
	for {
		ep.mu.Lock()
		list := ep.idle[addr]
		if len(list) == 0 {
			ep.mu.Unlock()
			return -1, false
		}
		c := list[len(list)-1]
		ep.idle[addr] = list[:len(list)-1]
		// The oldest are at the front: drop those past their age.
		now := time.Now()
		var stale []int
		for len(ep.idle[addr]) > 0 && now.Sub(ep.idle[addr][0].since) > ep.maxAge {
			stale = append(stale, ep.idle[addr][0].fd)
			ep.idle[addr] = ep.idle[addr][1:]
		}
		ep.mu.Unlock()
		for _, fd := range stale {
			closeFD(fd)
		}
		if now.Sub(c.since) <= ep.maxAge && idleAlive(c.fd) {
			return c.fd, true
		}
		closeFD(c.fd)
	}
}

// close closes every idle connection.
func (ep *enginePool) close() {
	ep.mu.Lock()
	idle := ep.idle
	ep.idle = map[string][]idleEngineConn{}
	ep.mu.Unlock()
	for _, list := range idle {
		for _, c := range list {
			closeFD(c.fd)
		}
	}
}

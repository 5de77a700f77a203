package host

import (
	"errors"
	"net"
	"sync"
	"syscall"
)

// limitListener accepts at most n connections at once, as
// x/net/netutil's LimitListener does, with connections that keep their
// socket reachable (syscall.Conn) and can hand it on: the relay's event
// loop takes a stream's client socket out of net/http (proxy.Detacher),
// and the connection's slot is freed when the loop is done with it, not
// when net/http lets go of the connection.
type limitListener struct {
	net.Listener
	sem chan struct{}
}

func newLimitListener(ln net.Listener, n int) net.Listener {
	return &limitListener{Listener: ln, sem: make(chan struct{}, n)}
}

func (l *limitListener) Accept() (net.Conn, error) {
	l.sem <- struct{}{}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	return &limitedConn{Conn: c, sem: l.sem}, nil
}

// limitedConn holds one of its listener's slots until it is closed, or,
// detached, until the detacher releases it.
type limitedConn struct {
	net.Conn
	sem      chan struct{}
	once     sync.Once
	mu       sync.Mutex
	detached bool
}

func (c *limitedConn) release() { c.once.Do(func() { <-c.sem }) }

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.mu.Lock()
	detached := c.detached
	c.mu.Unlock()
	if !detached {
		c.release()
	}
	return err
}

// SyscallConn is the socket's, where the accepted connection has one.
func (c *limitedConn) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := c.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

// Detach says the socket lives on after Close (a duplicate of it): the
// slot is freed by release.
func (c *limitedConn) Detach() (release func()) {
	c.mu.Lock()
	c.detached = true
	c.mu.Unlock()
	return c.release
}

// Package listener is the Host's client listener: a bound on the
// connections served at once whose connections can hand their socket on,
// and that takes connections back to serve them again.
package listener

import (
	"errors"
	"net"
	"sync"
	"syscall"
)

// Listener is the Host's client listener. It accepts at most n
// connections at once (n ≤ 0: any number), as x/net/netutil's
// LimitListener does, with connections that keep their socket reachable
// (syscall.Conn) and can hand it on: the relay's event loop takes a
// stream's client socket out of net/http (proxy.Detacher), and the
// connection's slot is freed when the loop is done with it, not when
// net/http lets go of the connection. And it takes connections back
// (Reserve): a client connection whose stream the loop relayed is served
// again, for the client's next request, as if newly accepted.
type Listener struct {
	net.Listener
	sem      chan struct{} // nil: no limit
	back     chan net.Conn // connections handed back, to be accepted again
	accepted chan acceptResult
	once     sync.Once
	closed   chan struct{}
}

type acceptResult struct {
	c   net.Conn
	err error
}

// New wraps ln: at most n connections at once (n ≤ 0: any number).
func New(ln net.Listener, n int) *Listener {
	l := &Listener{Listener: ln, back: make(chan net.Conn, 64), accepted: make(chan acceptResult), closed: make(chan struct{})}
	if n > 0 {
		l.sem = make(chan struct{}, n)
	}
	go l.acceptLoop()
	return l
}

// acceptLoop accepts from the inner listener, one connection ahead of
// Accept at the most (the channel is unbuffered).
func (l *Listener) acceptLoop() {
	for {
		c, err := l.Listener.Accept()
		select {
		case l.accepted <- acceptResult{c, err}:
		case <-l.closed:
			if c != nil {
				c.Close()
			}
			return
		}
		if err != nil && errors.Is(err, net.ErrClosed) {
			return
		}
	}
}

func (l *Listener) Accept() (net.Conn, error) {
	if l.sem != nil {
		select {
		case l.sem <- struct{}{}:
		case <-l.closed:
			return nil, net.ErrClosed
		}
	}
	select {
	case c := <-l.back:
		return l.wrap(c), nil
	case r := <-l.accepted:
		if r.err != nil {
			l.releaseSlot()
			return nil, r.err
		}
		return l.wrap(r.c), nil
	case <-l.closed:
		l.releaseSlot()
		return nil, net.ErrClosed
	}
}

func (l *Listener) releaseSlot() {
	if l.sem != nil {
		<-l.sem
	}
}

func (l *Listener) wrap(c net.Conn) net.Conn {
	return &limitedConn{Conn: c, release: l.releaseSlot}
}

func (l *Listener) Close() error {
	l.once.Do(func() { close(l.closed) })
	err := l.Listener.Close()
	for {
		select {
		case c := <-l.back:
			c.Close()
		default:
			return err
		}
	}
}

// Reserve hands c (a client connection between two requests) back, to be
// accepted and served again; false when the listener is closed or
// busy (the caller closes c).
func (l *Listener) Reserve(c net.Conn) bool {
	select {
	case <-l.closed:
		return false
	default:
	}
	select {
	case l.back <- c:
		return true
	default:
		return false
	}
}

// limitedConn holds one of its listener's slots until it is closed, or,
// detached, until the detacher releases it.
type limitedConn struct {
	net.Conn
	release  func()
	once     sync.Once
	mu       sync.Mutex
	detached bool
}

func (c *limitedConn) releaseOnce() { c.once.Do(c.release) }

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.mu.Lock()
	detached := c.detached
	c.mu.Unlock()
	if !detached {
		c.releaseOnce()
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
	return c.releaseOnce
}

package listener

import (
	"net"
	"syscall"
	"testing"
	"time"
)

// A connection holds its slot until it closes — or, detached (the
// relay's event loop took its socket), until the detacher releases it —
// and keeps its socket reachable.
func TestLimitListenerHoldsASlotPerConnection(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := New(inner, 1)
	defer ln.Close()
	accepted := make(chan net.Conn, 2)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", inner.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	dial()
	first := <-accepted
	if _, ok := first.(syscall.Conn); !ok {
		t.Fatal("an accepted connection hides its socket")
	}
	dial()
	select {
	case <-accepted:
		t.Fatal("a second connection was accepted while the first held the only slot")
	case <-time.After(100 * time.Millisecond):
	}
	release := first.(interface{ Detach() func() }).Detach()
	first.Close()
	select {
	case <-accepted:
		t.Fatal("a detached connection's Close freed its slot")
	case <-time.After(100 * time.Millisecond):
	}
	release()
	select {
	case second := <-accepted:
		second.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the slot was not freed by the release")
	}
}

// A connection handed back (Reserve) is accepted again, and served.
func TestAConnectionHandedBackIsAcceptedAgain(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln := New(inner, 0)
	defer ln.Close()
	client, err := net.Dial("tcp", inner.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	first, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	if !ln.Reserve(first) {
		t.Fatal("the listener did not take the connection back")
	}
	again, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	_, _ = client.Write([]byte("x"))
	b := make([]byte, 1)
	_ = again.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := again.Read(b); err != nil || b[0] != 'x' {
		t.Fatalf("read %q, %v from the connection accepted again", b, err)
	}
}

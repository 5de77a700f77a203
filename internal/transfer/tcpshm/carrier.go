package tcpshm

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
)

// A Carrier moves frames' payloads outside the TCP stream: the rdma data
// plane puts each payload into staging memory the target registered, and
// the stream carries only the frames' headers and descriptors. Everything
// else is tcp_shm's: the handshake that proves both ends hold the
// migration's secret, the xxhash64 of every payload checked on arrival,
// the block guard checked before a byte reaches the engine's memory, the
// acknowledgement at the end of each connection's share.
type Carrier interface {
	// Mode names the carrier in the handshake (the target must offer it).
	Mode() string
	// Open starts one connection's carriage from the target's greeting
	// (what its Receiver's Greeting returned, as JSON).
	Open(greeting json.RawMessage) (CarrierConn, error)
}

// CarrierConn is one connection's carriage on the source.
type CarrierConn interface {
	// Slots and SlotSize are the target's staging: payload k goes into
	// slot k % Slots, once the target has taken payload k − Slots out.
	Slots() int
	SlotSize() int
	// Buffer is where the frames for a slot are assembled (SlotSize
	// bytes of memory the carrier can send from; one per slot, so the
	// next frame is assembled while the last one is put).
	Buffer(slot int) []byte
	// Put writes payload into a staging slot and returns once the target
	// holds it.
	Put(slot int, payload []byte) error
	Close()
}

// Receiver is a carrier's target side for one connection.
type Receiver interface {
	// Greeting is sent to the source after the handshake.
	Greeting() any
	// Payload is the n bytes the source put into slot.
	Payload(slot int, n uint64) ([]byte, error)
	Close()
}

// NewReceiver makes a connection's Receiver for a carrier mode the target
// offers (Options.Receivers).
type NewReceiver func() (Receiver, error)

// Frames whose payload came through a carrier have this bit in their
// kind, and their staging slot in the bits above slotShift.
const (
	kindCarried = 1 << 8
	slotShift   = 16
	kindMask    = 0xff
)

// greetingMsg is the target's first line on a carried connection.
type greetingMsg struct {
	Greeting json.RawMessage `json:"greeting,omitempty"`
	Error    string          `json:"error,omitempty"`
}

// credits tracks, on the source, how many frames the target took out of
// their staging slots (its credit lines), and the final acknowledgement.
type credits struct {
	mu    sync.Mutex
	cond  *sync.Cond
	taken uint64
	final *ack
	err   error
}

func newCredits() *credits {
	c := &credits{}
	c.cond = sync.NewCond(&c.mu)
	return c
}

// read consumes the target's lines until its final acknowledgement (or
// an error).
func (c *credits) read(dec *json.Decoder) {
	for {
		var a ack
		err := dec.Decode(&a)
		c.mu.Lock()
		switch {
		case err != nil:
			c.err = fmt.Errorf("tcp_shm: no acknowledgement from the target: %w", err)
		case a.Credit > 0:
			c.taken = a.Credit
		default:
			c.final = &a
		}
		done := c.err != nil || c.final != nil
		c.cond.Broadcast()
		c.mu.Unlock()
		if done {
			return
		}
	}
}

// await blocks until the target took at least n frames out of staging, or
// the connection ended.
func (c *credits) await(n uint64) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.taken < n {
		switch {
		case c.final != nil && c.final.Error != "":
			return fmt.Errorf("tcp_shm: target: %s", c.final.Error)
		case c.final != nil:
			return errors.New("tcp_shm: the target acknowledged before taking every frame")
		case c.err != nil:
			return c.err
		}
		c.cond.Wait()
	}
	return nil
}

// result is the final acknowledgement, once it came.
func (c *credits) result() (ack, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for c.final == nil && c.err == nil {
		c.cond.Wait()
	}
	if c.final == nil {
		return ack{}, c.err
	}
	return *c.final, nil
}

// carriage is a connection's Carrier state on the source: the frames
// assembled and waiting for their put, and the sender that puts them and
// announces each on the stream.
type carriage struct {
	conn    CarrierConn
	credits *credits
	out     chan carriedFrame
	done    chan error
	mu      sync.Mutex
	failed  error // the sender's first error
}

// carriedFrame is one assembled frame: its payload in its slot's buffer.
type carriedFrame struct {
	slot    int
	payload []byte
	hdr     [frameHdrSize]byte
	descs   []byte
}

// start runs the sender: it writes to w, and on a failure calls abort
// (closing the connection, so that nothing waits on the target for
// ever).
func (c *carriage) start(w *bufio.Writer, abort func()) {
	c.out = make(chan carriedFrame, c.conn.Slots())
	c.done = make(chan error, 1)
	go func() {
		var failed error
		for fr := range c.out {
			if failed != nil {
				continue
			}
			err := c.conn.Put(fr.slot, fr.payload)
			for _, b := range [][]byte{fr.hdr[:], fr.descs} {
				if err == nil {
					_, err = w.Write(b)
				}
			}
			if err == nil {
				// The target acts on a frame once its header arrives.
				err = w.Flush()
			}
			if err != nil {
				failed = err
				c.mu.Lock()
				c.failed = err
				c.mu.Unlock()
				abort()
			}
		}
		c.done <- failed
	}()
}

func (c *carriage) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}

// enqueue hands a frame to the sender.
func (c *carriage) enqueue(fr carriedFrame) error {
	if err := c.err(); err != nil {
		return err
	}
	c.out <- fr
	return nil
}

// buffer returns the buffer frame k is assembled in, once it is free: the
// target took out frame k − Slots, which used that slot (and its put, the
// last reader of the buffer, had completed before the target could).
func (c *carriage) buffer(k uint64) ([]byte, error) {
	slots := uint64(c.conn.Slots())
	if k >= slots {
		if err := c.credits.await(k - slots + 1); err != nil {
			if serr := c.err(); serr != nil {
				return nil, serr
			}
			return nil, err
		}
	}
	return c.conn.Buffer(int(k % slots)), nil
}

// finish waits for the sender to put and announce every queued frame.
func (c *carriage) finish() error {
	close(c.out)
	return <-c.done
}

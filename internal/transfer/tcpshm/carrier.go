package tcpshm

import (
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
	// Buffer is where frames are assembled (SlotSize bytes of memory the
	// carrier can send from).
	Buffer() []byte
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

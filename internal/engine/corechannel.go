package engine

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// CoreChannel is the agent's direct line into a vLLM engine core: the
// plugin's core channel (--vllm-hi-core-socket), a Unix socket served by
// a thread of the EngineCore process whose commands the busy loop runs at
// its next step boundary. It skips vLLM's API server, whose event loop
// also serves every client stream (docs/vllm-plugin.md).
//
// Wire: a 4-byte big-endian length, then a JSON object; a connection
// opens with a hello carrying the agent token. Requests on one connection
// are answered in order, so the channel keeps a few connections and uses
// one per call in flight.
type CoreChannel struct {
	path, token string
	mu          sync.Mutex
	idle        []*coreConn
	closed      bool
	nextID      uint64
	// ops are the commands the engine's channel takes, as its hello
	// listed them (none listed: a plugin from before the list).
	ops map[string]bool
	// dials counts the connections opened.
	dials atomic.Int64
}

// coreChannelVersion is the wire version this client speaks.
const coreChannelVersion = 1

// maxCoreFrame bounds an answer (an export of hundreds of requests'
// token ids fits many times over).
const maxCoreFrame = 256 << 20

// maxIdleCoreConns is how many connections the channel keeps open, and
// warmCoreConns how many it opens up front: a migration's pause sends a
// dozen calls at once to one engine (the pause, eight export chunks, the
// copy round's inputs, the check's layout), and a call that finds no idle
// connection dials one, which inside the pause took up to 11 ms (the
// engine core's threads wait for the busy loop's GIL; H100, 2026-12-06).
const (
	maxIdleCoreConns = 16
	warmCoreConns    = 12
)

type coreConn struct{ c net.Conn }

// CoreError is an error the engine core answered.
type CoreError struct {
	Op      string
	Status  int
	Message string
	Param   string
}

func (e *CoreError) Error() string {
	return fmt.Sprintf("engine core %s: %d: %s", e.Op, e.Status, e.Message)
}

// Unwrap is the failure's kind, by the status the hooks contract gives it.
func (e *CoreError) Unwrap() error { return errdefs.FromHTTP(e.Status) }

// CoreTiming is where a call's time went: Wait is how long the command
// waited for a step boundary in the engine core, Core its own time there
// (both as the engine measured them), Total the round trip as the caller
// saw it, Conn the part of it spent getting a connection (dialling one
// when none was idle), Decode the part spent decoding the answer; Sent
// and Received are the frames' sizes. What Total has beyond the others is
// the frames' way through the socket and the channel's threads.
type CoreTiming struct {
	Wait, Core, Total, Conn, Decode time.Duration
	Sent, Received                  int
}

// DialCore connects to the core channel at path with the agent token and
// checks its version.
func DialCore(ctx context.Context, path, token string) (*CoreChannel, error) {
	ch := &CoreChannel{path: path, token: token}
	c, ops, err := ch.dial(ctx)
	if err != nil {
		return nil, err
	}
	ch.ops = make(map[string]bool, len(ops))
	for _, op := range ops {
		ch.ops[op] = true
	}
	ch.put(c)
	go ch.warm(warmCoreConns - 1)
	return ch, nil
}

// warm opens n more connections for the idle pool, in the background
// (the first call need not wait for them); it stops at the first failure
// (a call then dials its own, and says why if that fails too).
func (ch *CoreChannel) warm(n int) {
	ctx, cancel := context.WithTimeout(context.Background(), defaultTimeout)
	defer cancel()
	for range n {
		c, _, err := ch.dial(ctx)
		if err != nil {
			return
		}
		ch.put(c)
	}
}

// Takes reports whether the engine's channel takes op (its hello listed
// it): an agent newer than the engine's plugin uses HTTP for the rest.
func (ch *CoreChannel) Takes(op string) bool { return ch.ops[op] }

func (ch *CoreChannel) dial(ctx context.Context) (*coreConn, []string, error) {
	ch.dials.Add(1)
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", ch.path)
	if err != nil {
		return nil, nil, fmt.Errorf("core channel %s: %w", ch.path, err)
	}
	c := &coreConn{c: nc}
	setDeadline(ctx, nc)
	var hello struct {
		OK *struct {
			Version int      `json:"version"`
			Ops     []string `json:"ops"`
		} `json:"ok"`
		Error *coreErrorBody `json:"error"`
	}
	_, _, err = c.roundTrip(map[string]any{"op": "hello", "token": ch.token, "version": coreChannelVersion}, &hello)
	switch {
	case err != nil:
	case hello.Error != nil:
		err = hello.Error.err("hello")
	case hello.OK == nil || hello.OK.Version != coreChannelVersion:
		err = fmt.Errorf("the engine core speaks another core channel version: %+v", hello.OK)
	}
	if err != nil {
		nc.Close()
		return nil, nil, fmt.Errorf("core channel %s: %w", ch.path, err)
	}
	return c, hello.OK.Ops, nil
}

func setDeadline(ctx context.Context, c net.Conn) {
	dl, ok := ctx.Deadline()
	if !ok {
		dl = time.Now().Add(defaultTimeout)
	}
	_ = c.SetDeadline(dl)
}

func (ch *CoreChannel) get(ctx context.Context) (*coreConn, error) {
	ch.mu.Lock()
	if ch.closed {
		ch.mu.Unlock()
		return nil, net.ErrClosed
	}
	if n := len(ch.idle); n > 0 {
		c := ch.idle[n-1]
		ch.idle = ch.idle[:n-1]
		ch.mu.Unlock()
		return c, nil
	}
	ch.mu.Unlock()
	c, _, err := ch.dial(ctx)
	return c, err
}

func (ch *CoreChannel) put(c *coreConn) {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.closed || len(ch.idle) >= maxIdleCoreConns {
		c.c.Close()
		return
	}
	ch.idle = append(ch.idle, c)
}

// Close closes the channel's connections.
func (ch *CoreChannel) Close() error {
	ch.mu.Lock()
	defer ch.mu.Unlock()
	ch.closed = true
	for _, c := range ch.idle {
		c.c.Close()
	}
	ch.idle = nil
	return nil
}

type coreErrorBody struct {
	Status  int    `json:"status"`
	Message string `json:"message"`
	Param   string `json:"param"`
}

func (e *coreErrorBody) err(op string) error {
	return &CoreError{Op: op, Status: e.Status, Message: e.Message, Param: e.Param}
}

// Call runs op with payload in the engine core and decodes its answer
// into out (nil: discard it). A call that the context ends is abandoned
// with its connection; the engine may still run it.
func (ch *CoreChannel) Call(ctx context.Context, op string, payload, out any) (CoreTiming, error) {
	start := time.Now()
	c, err := ch.get(ctx)
	if err != nil {
		return CoreTiming{}, err
	}
	t := CoreTiming{Conn: time.Since(start)}
	ch.mu.Lock()
	ch.nextID++
	id := ch.nextID
	ch.mu.Unlock()
	if payload == nil {
		payload = struct{}{}
	}
	var ans struct {
		ID     uint64          `json:"id"`
		OK     json.RawMessage `json:"ok"`
		Error  *coreErrorBody  `json:"error"`
		CoreMS float64         `json:"core_ms"`
		WaitMS float64         `json:"wait_ms"`
	}
	setDeadline(ctx, c.c)
	if t.Sent, t.Received, err = c.roundTrip(map[string]any{"id": id, "op": op, "payload": payload}, &ans); err != nil {
		c.c.Close()
		if ctx.Err() != nil {
			err = fmt.Errorf("%w (%v)", ctx.Err(), err)
		}
		t.Total = time.Since(start)
		return t, fmt.Errorf("engine core %s: %w", op, err)
	}
	ch.put(c)
	t.Wait, t.Core = ms(ans.WaitMS), ms(ans.CoreMS)
	decoded := time.Now()
	switch {
	case ans.Error != nil:
		err = ans.Error.err(op)
	case ans.ID != id:
		err = fmt.Errorf("engine core %s: answer %d to request %d", op, ans.ID, id)
	case out != nil:
		if derr := json.Unmarshal(ans.OK, out); derr != nil {
			err = fmt.Errorf("engine core %s: decode: %w", op, derr)
		}
	}
	t.Decode, t.Total = time.Since(decoded), time.Since(start)
	return t, err
}

func ms(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

// roundTrip writes one frame and reads one; it returns their sizes.
func (c *coreConn) roundTrip(req, out any) (sent, received int, err error) {
	body, err := json.Marshal(req)
	if err != nil {
		return 0, 0, err
	}
	frame := make([]byte, 4+len(body))
	binary.BigEndian.PutUint32(frame, uint32(len(body)))
	copy(frame[4:], body)
	if _, err := c.c.Write(frame); err != nil {
		return len(frame), 0, err
	}
	var hdr [4]byte
	if _, err := io.ReadFull(c.c, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) {
			return len(frame), 0, fmt.Errorf("the engine core closed the connection")
		}
		return len(frame), 0, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxCoreFrame {
		return len(frame), 4, fmt.Errorf("an answer of %d bytes is over the limit of %d", n, maxCoreFrame)
	}
	buf := make([]byte, n)
	if _, err := io.ReadFull(c.c, buf); err != nil {
		return len(frame), 4, err
	}
	return len(frame), 4 + len(buf), json.Unmarshal(buf, out)
}

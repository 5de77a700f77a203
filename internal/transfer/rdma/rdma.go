// Package rdma is the rdma data plane: KV moved by one-sided puts of UCX
// (its UCP API, loaded at run time from libucp like libcuda), over
// InfiniBand or RoCE verbs where the NIC exists and over UCX's TCP and
// shared-memory transports everywhere else (UCX_TLS, UCX_NET_DEVICES
// choose).
//
// It rides on tcp_shm's connection (a tcpshm.Carrier): the source
// authenticates to the target agent's data port exactly as tcp_shm does
// (an HMAC over fresh nonces with the migration's secret, TLS when
// configured). The target then greets it with its UCX worker address and
// the remote key of staging memory registered for that connection only.
// The source assembles each frame as tcp_shm does, checksums it and puts
// it into a staging slot. Once the put is flushed, it sends the frame's
// header and descriptors on the connection. The target verifies the
// checksum and the block guard before it copies anything into the
// engine's memory, and credits the slot back. So a source never holds a
// key to the engine's KV itself, nothing lands outside the migration's
// reserved blocks, and every byte is checked as on tcp_shm; the payload
// crosses the network through UCX rather than the TCP stream. The KV
// bytes are not encrypted on UCX's transports (RDMA NICs do not encrypt
// either), even when the control connection is TLS.
package rdma

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"
	"unsafe"

	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// Mode is the carrier's name in tcp_shm's handshake.
const Mode = "rdma"

// Staging: slots per connection, each one frame (tcp_shm's largest).
const (
	stagingSlots = 4
	slotSize     = 4 << 20
	// putTimeout bounds one put and its flush (a frame of at most 4 MiB).
	putTimeout = 30 * time.Second
)

// Plane is an agent's UCX context; it makes the carrier a source sends
// through and the receivers a target greets sources with. Workers and
// their buffers outlive connections (a round opens tn of them, and a
// worker and 16 MiB of fresh memory per connection cost more than the
// round's copy); each connection still gets its own endpoint and its own
// registration of the target's staging, so a key handed to one source
// is dead once its connection ends.
type Plane struct {
	lib *Lib
	ctx *Context
	res Resources

	mu      sync.Mutex
	targets []*targetRes // idle receivers' workers and staging
	sources []*sourceRes // idle sources' workers and frame buffers
}

// keepIdle bounds each pool (a round uses tn connections, default 2).
const keepIdle = 8

// targetRes is what a receiver keeps between connections.
type targetRes struct {
	w       *Worker
	addr    []byte
	staging []byte
}

// sourceRes is what a source connection keeps between connections.
type sourceRes struct {
	w    *Worker
	bufs [][]byte // one frame buffer per staging slot
}

func (t *targetRes) release() {
	t.w.Close()
	CFree(t.staging)
}

func (r *sourceRes) release() {
	r.w.Close()
	for _, b := range r.bufs {
		CFree(b)
	}
}

// Open loads libucp and creates the agent's context. It returns an error
// wrapping ErrUnavailable where UCX is not installed.
func Open() (*Plane, error) {
	l, err := Load()
	if err != nil {
		return nil, err
	}
	c, err := l.NewContext()
	if err != nil {
		l.Close()
		return nil, err
	}
	return &Plane{lib: l, ctx: c, res: c.Resources()}, nil
}

// Close releases the pools, the context and the library (after every
// connection ended).
func (p *Plane) Close() {
	p.mu.Lock()
	for _, t := range p.targets {
		t.release()
	}
	for _, s := range p.sources {
		s.release()
	}
	p.targets, p.sources = nil, nil
	p.mu.Unlock()
	p.ctx.Close()
	p.lib.Close()
}

// Version is the loaded UCX's version.
func (p *Plane) Version() string { return p.lib.Version() }

// Resources are UCX's transports and RDMA devices here.
func (p *Plane) Resources() Resources { return p.res }

var (
	_ tcpshm.Carrier     = (*Plane)(nil)
	_ tcpshm.CarrierConn = (*sourceConn)(nil)
	_ tcpshm.Receiver    = (*receiver)(nil)
)

// Mode implements tcpshm.Carrier.
func (p *Plane) Mode() string { return Mode }

// greeting is what a target sends a source for one connection.
type greeting struct {
	Worker   []byte `json:"worker"`    // UCX worker address
	Base     uint64 `json:"base"`      // staging's address
	Key      []byte `json:"key"`       // staging's packed remote key
	Slots    int    `json:"slots"`     // staging slots
	SlotSize int    `json:"slot_size"` // bytes per slot
}

// receiver is the target side of one connection: a worker of its own,
// progressed on a goroutine (UCX's TCP transport emulates one-sided puts
// with messages the target must process), and staging registered for
// this connection.
type receiver struct {
	p    *Plane
	res  *targetRes
	reg  *Registration
	stop chan struct{}
	done chan struct{}
}

// NewReceiver implements tcpshm.NewReceiver for a target's data server.
func (p *Plane) NewReceiver() (tcpshm.Receiver, error) {
	p.mu.Lock()
	var t *targetRes
	if n := len(p.targets); n > 0 {
		t, p.targets = p.targets[n-1], p.targets[:n-1]
	}
	p.mu.Unlock()
	if t == nil {
		w, err := p.ctx.NewWorker()
		if err != nil {
			return nil, err
		}
		t = &targetRes{w: w}
		if t.addr, err = w.Address(); err != nil {
			t.release()
			return nil, err
		}
		if t.staging = CAlloc(stagingSlots * slotSize); t.staging == nil {
			t.release()
			return nil, errors.New("rdma: no memory for the staging")
		}
	}
	reg, err := p.ctx.Register(unsafe.Pointer(&t.staging[0]), len(t.staging))
	if err != nil {
		t.release()
		return nil, err
	}
	r := &receiver{p: p, res: t, reg: reg, stop: make(chan struct{}), done: make(chan struct{})}
	go r.progress()
	return r, nil
}

func (r *receiver) progress() {
	defer close(r.done)
	idle := 0
	for {
		select {
		case <-r.stop:
			return
		default:
		}
		if r.res.w.Progress() {
			idle = 0
			continue
		}
		// Spin briefly, then back off: a put in flight is served within
		// microseconds, an idle connection costs next to nothing.
		if idle++; idle > 64 {
			time.Sleep(20 * time.Microsecond)
		}
	}
}

func (r *receiver) Greeting() any {
	return greeting{Worker: r.res.addr, Base: uint64(r.reg.Base), Key: r.reg.Key, Slots: stagingSlots, SlotSize: slotSize}
}

func (r *receiver) Payload(slot int, n uint64) ([]byte, error) {
	if slot < 0 || slot >= stagingSlots || n > slotSize {
		return nil, fmt.Errorf("rdma: frame in staging slot %d of %d bytes is outside the staging", slot, n)
	}
	at := slot * slotSize
	return r.res.staging[at : at+int(n)], nil
}

// Close ends the connection's registration (its key stops working) and
// keeps the worker and staging for the next connection.
func (r *receiver) Close() {
	close(r.stop)
	<-r.done
	r.reg.Close()
	r.p.mu.Lock()
	defer r.p.mu.Unlock()
	if len(r.p.targets) < keepIdle {
		r.p.targets = append(r.p.targets, r.res)
		return
	}
	r.res.release()
}

// sourceConn is one connection's carriage on the source: a worker and
// frame buffers (pooled), and an endpoint to the target's worker.
type sourceConn struct {
	p       *Plane
	res     *sourceRes
	ep      *Endpoint
	key     *RemoteKey
	g       greeting
	broken  bool // a put failed: the worker is not reused
	closeMu sync.Once
}

// Open implements tcpshm.Carrier.
func (p *Plane) Open(raw json.RawMessage) (tcpshm.CarrierConn, error) {
	var g greeting
	if err := json.Unmarshal(raw, &g); err != nil {
		return nil, fmt.Errorf("rdma: the target's greeting: %w", err)
	}
	if g.Slots < 1 || g.Slots > 64 || g.SlotSize < 1 || g.SlotSize > 64<<20 || len(g.Worker) == 0 || len(g.Key) == 0 {
		return nil, fmt.Errorf("rdma: the target's greeting lacks its staging (%d slots of %d bytes)", g.Slots, g.SlotSize)
	}
	p.mu.Lock()
	var res *sourceRes
	for i := len(p.sources) - 1; i >= 0; i-- {
		if r := p.sources[i]; len(r.bufs) == g.Slots && len(r.bufs[0]) == g.SlotSize {
			res = r
			p.sources = append(p.sources[:i], p.sources[i+1:]...)
			break
		}
	}
	p.mu.Unlock()
	if res == nil {
		w, err := p.ctx.NewWorker()
		if err != nil {
			return nil, err
		}
		res = &sourceRes{w: w}
		for i := 0; i < g.Slots; i++ {
			b := CAlloc(g.SlotSize)
			if b == nil {
				res.release()
				return nil, errors.New("rdma: no memory for the frame buffers")
			}
			res.bufs = append(res.bufs, b)
		}
	}
	c := &sourceConn{p: p, res: res, g: g}
	fail := func(err error) (tcpshm.CarrierConn, error) {
		c.broken = true
		c.Close()
		return nil, err
	}
	var err error
	if c.ep, err = res.w.Connect(g.Worker); err != nil {
		return fail(err)
	}
	if c.key, err = c.ep.Unpack(g.Key); err != nil {
		return fail(err)
	}
	return c, nil
}

func (c *sourceConn) Slots() int             { return c.g.Slots }
func (c *sourceConn) SlotSize() int          { return c.g.SlotSize }
func (c *sourceConn) Buffer(slot int) []byte { return c.res.bufs[slot] }

func (c *sourceConn) Put(slot int, payload []byte) error {
	if slot < 0 || slot >= c.g.Slots || len(payload) > c.g.SlotSize {
		return fmt.Errorf("rdma: a frame of %d bytes does not fit staging slot %d", len(payload), slot)
	}
	if len(payload) == 0 {
		return nil
	}
	remote := c.g.Base + uint64(slot)*uint64(c.g.SlotSize)
	err := c.ep.PutFlush(c.key, []Put{{Local: unsafe.Pointer(&payload[0]), Len: len(payload), Remote: remote}}, putTimeout)
	if err != nil {
		c.broken = true
	}
	return err
}

// Close closes the endpoint and keeps the worker and buffers for the
// next connection (unless a put failed on it).
func (c *sourceConn) Close() {
	c.closeMu.Do(func() {
		if c.key != nil {
			c.key.Close()
		}
		if c.ep != nil {
			if c.ep.Failed() != nil {
				c.broken = true
			}
			c.ep.Close()
		}
		c.p.mu.Lock()
		defer c.p.mu.Unlock()
		if !c.broken && len(c.p.sources) < keepIdle {
			c.p.sources = append(c.p.sources, c.res)
			return
		}
		c.res.release()
	})
}

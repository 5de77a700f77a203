package tcpshm

import (
	"bufio"
	"crypto/hmac"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"
)

// Session is what a target accepts for one migration: the secret its
// source must prove it holds, when it stops accepting writes, and how to
// reach the memory (opened only once the peer authenticated).
type Session struct {
	Secret  []byte
	Expires time.Time
	Open    func() (*Memory, error)
}

// Target resolves a session id; an error refuses the connection.
type Target func(session string) (*Session, error)

// Options bound what the data server gives to peers.
type Options struct {
	// MaxConns bounds authenticated connections at once (each holds a
	// frame buffer of ~5 MiB); further ones are refused.
	MaxConns int
	// MaxHandshakes bounds connections that have not authenticated yet
	// (each holds a few KiB); further ones are closed at once.
	MaxHandshakes int
	// HandshakeTimeout bounds the TLS and HMAC handshake.
	HandshakeTimeout time.Duration
	// IdleTimeout bounds the wait for the next frame.
	IdleTimeout time.Duration
	// TLS, when set, wraps every connection in TLS.
	TLS *tls.Config
	// Receivers are the carrier modes this target offers, by name (see
	// Carrier); a source asking for another is refused.
	Receivers map[string]NewReceiver
}

// Defaults of Options.
const (
	DefaultMaxConns         = 64
	DefaultMaxHandshakes    = 16
	DefaultHandshakeTimeout = 5 * time.Second
	DefaultIdleTimeout      = 30 * time.Second
)

func (o *Options) fill() {
	if o.MaxConns <= 0 {
		o.MaxConns = DefaultMaxConns
	}
	if o.MaxHandshakes <= 0 {
		o.MaxHandshakes = DefaultMaxHandshakes
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = DefaultIdleTimeout
	}
}

// Server is the target side: it accepts data connections and writes frames
// into the memory its Target resolves.
type Server struct {
	ln         net.Listener
	target     Target
	opt        Options
	log        *zap.Logger
	wg         sync.WaitGroup
	handshakes chan struct{}
	conns      chan struct{}
	buffers    sync.Pool // *frameBuffers, for authenticated connections only
}

type frameBuffers struct {
	descs, payload []byte
}

// Listen starts a data server on addr.
func Listen(addr string, target Target, opt Options, log *zap.Logger) (*Server, error) {
	opt.fill()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcp_shm: listen %s: %w", addr, err)
	}
	s := &Server{ln: ln, target: target, opt: opt, log: log,
		handshakes: make(chan struct{}, opt.MaxHandshakes), conns: make(chan struct{}, opt.MaxConns)}
	s.buffers.New = func() any {
		return &frameBuffers{descs: make([]byte, maxRuns*runDescSize), payload: make([]byte, maxFrame)}
	}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Addr is the listening address.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Close stops accepting and waits for connections in progress.
func (s *Server) Close() error {
	err := s.ln.Close()
	s.wg.Wait()
	return err
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if ne, ok := err.(net.Error); ok && ne.Timeout() {
				continue
			}
			return
		}
		select {
		case s.handshakes <- struct{}{}:
		default:
			// Too many peers that have not authenticated: refuse without
			// spending anything on them.
			c.Close()
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			if err := s.serve(c); err != nil && !errors.Is(err, io.EOF) {
				s.log.Warn("tcp_shm data connection failed", zap.String("remote", c.RemoteAddr().String()), zap.Error(err))
			}
		}()
	}
}

// handshake authenticates a connection. It returns the session and the
// connection to read frames from (TLS-wrapped when configured); the
// caller owns the returned connection slot.
func (s *Server) handshake(raw net.Conn) (net.Conn, *Session, *Memory, string, error) {
	defer func() { <-s.handshakes }()
	_ = raw.SetDeadline(time.Now().Add(s.opt.HandshakeTimeout))
	c := raw
	if s.opt.TLS != nil {
		tc := tls.Server(raw, s.opt.TLS)
		if err := tc.Handshake(); err != nil {
			return nil, nil, nil, "", fmt.Errorf("TLS handshake: %w", err)
		}
		c = tc
	}
	br := bufio.NewReaderSize(c, maxLine)
	m := make([]byte, len(magic))
	if _, err := io.ReadFull(br, m); err != nil || string(m) != magic {
		return nil, nil, nil, "", fmt.Errorf("not a tcp_shm/3 client")
	}
	var h helloMsg
	if err := readLine(br, &h); err != nil {
		return nil, nil, nil, "", fmt.Errorf("bad hello: %w", err)
	}
	sess, err := s.target(h.Session)
	if err == nil && time.Now().After(sess.Expires) {
		err = fmt.Errorf("migration %q expired on this target", h.Session)
	}
	if err == nil && len(sess.Secret) < MinSecret {
		err = fmt.Errorf("migration %q has no secret here", h.Session)
	}
	if err != nil {
		_ = writeLine(c, challengeMsg{Error: err.Error()})
		return nil, nil, nil, "", err
	}
	if err == nil && h.Mode != "" && s.opt.Receivers[h.Mode] == nil {
		err = fmt.Errorf("this target has no %s data plane", h.Mode)
	}
	if err != nil {
		_ = writeLine(c, challengeMsg{Error: err.Error()})
		return nil, nil, nil, "", err
	}
	if len(h.Nonce) < 16 {
		_ = writeLine(c, challengeMsg{Error: "hello without a nonce"})
		return nil, nil, nil, "", errAuth
	}
	sn := nonce()
	if err := writeLine(c, challengeMsg{Nonce: sn}); err != nil {
		return nil, nil, nil, "", err
	}
	var p proofMsg
	if err := readLine(br, &p); err != nil {
		return nil, nil, nil, "", fmt.Errorf("no proof: %w", err)
	}
	if !hmac.Equal(p.Proof, proof(sess.Secret, "client", h.Session, h.Nonce, sn)) {
		_ = writeLine(c, proofMsg{Error: "authentication failed"})
		return nil, nil, nil, "", fmt.Errorf("%w: migration %s", errAuth, h.Session)
	}
	if br.Buffered() > 0 {
		return nil, nil, nil, "", errors.New("the client sent frames before the target's proof")
	}
	select {
	case s.conns <- struct{}{}:
	default:
		_ = writeLine(c, proofMsg{Error: fmt.Sprintf("too many data connections (at most %d)", s.opt.MaxConns)})
		return nil, nil, nil, "", errors.New("connection limit reached")
	}
	mem, err := sess.Open()
	if err == nil && mem.Guard == nil {
		err = errors.New("target memory without a block guard")
	}
	if err != nil {
		<-s.conns
		_ = writeLine(c, proofMsg{Error: err.Error()})
		return nil, nil, nil, "", err
	}
	if err := writeLine(c, proofMsg{Proof: proof(sess.Secret, "server", h.Session, h.Nonce, sn)}); err != nil {
		<-s.conns
		return nil, nil, nil, "", err
	}
	return c, sess, mem, h.Mode, nil
}

func (s *Server) serve(raw net.Conn) error {
	c, sess, mem, mode, err := s.handshake(raw)
	if err != nil {
		return err
	}
	defer func() { <-s.conns }()
	// The handshake's deadline ends with it: a round may stream for longer
	// (each frame read has its own deadline below, the answer its own).
	_ = c.SetDeadline(time.Time{})
	if cl, ok := mem.Sink.(io.Closer); ok {
		defer cl.Close()
	}
	bufs := s.buffers.Get().(*frameBuffers)
	defer s.buffers.Put(bufs)
	r := bufio.NewReaderSize(c, 1<<20)
	reply := func(a ack) error {
		_ = c.SetWriteDeadline(time.Now().Add(s.opt.IdleTimeout))
		return json.NewEncoder(c).Encode(a)
	}
	fail := func(format string, args ...any) error {
		msg := fmt.Sprintf(format, args...)
		_ = reply(ack{Error: msg})
		return errors.New(msg)
	}
	var rcv Receiver
	if mode != "" {
		// The payloads come by the carrier: greet the source with what it
		// needs to put them (its staging's address and key).
		if rcv, err = s.opt.Receivers[mode](); err != nil {
			_ = writeLine(c, greetingMsg{Error: err.Error()})
			return fmt.Errorf("%s receiver: %w", mode, err)
		}
		defer rcv.Close()
		g, err := json.Marshal(rcv.Greeting())
		if err != nil {
			return err
		}
		_ = c.SetWriteDeadline(time.Now().Add(s.opt.IdleTimeout))
		if err := writeLine(c, greetingMsg{Greeting: g}); err != nil {
			return err
		}
	}
	var places []slotPlace
	if mem.Layers > 0 {
		if places, err = slotPlaces(mem); err != nil {
			return fail("%v", err)
		}
	}
	var a ack
	var hdr [frameHdrSize]byte
	for {
		_ = c.SetReadDeadline(time.Now().Add(s.opt.IdleTimeout))
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return fmt.Errorf("read frame: %w", err)
		}
		f := readHeader(hdr[:])
		if f.runs == 0 {
			if mem.Sink != nil {
				if err := mem.Sink.Flush(); err != nil {
					return fail("%v", err)
				}
			}
			return reply(a)
		}
		if f.runs > maxRuns || f.length > maxFrame {
			return fail("frame of %d runs / %d bytes is over the limits", f.runs, f.length)
		}
		carried, slot := f.kind&kindCarried != 0, int(f.kind>>slotShift)
		f.kind &= kindMask
		if carried != (rcv != nil) {
			return fail("a frame whose payload did not come the way this connection carries them")
		}
		descSize := runDescSize
		switch f.kind {
		case frameRuns:
		case frameSlots:
			descSize = jobSize
		default:
			return fail("unknown frame kind %d", f.kind)
		}
		d := bufs.descs[:int(f.runs)*descSize]
		if _, err := io.ReadFull(r, d); err != nil {
			return fmt.Errorf("read frame runs: %w", err)
		}
		var p []byte
		if carried {
			if p, err = rcv.Payload(slot, f.length); err != nil {
				return fail("%v", err)
			}
		} else {
			p = bufs.payload[:f.length]
			if _, err := io.ReadFull(r, p); err != nil {
				return fmt.Errorf("read frame payload: %w", err)
			}
		}
		// The session may have expired while the round ran: the engine has
		// freed (or is about to free) the reserved blocks, and nothing may
		// land in them any more.
		if time.Now().After(sess.Expires) {
			return fail("the migration's session expired on this target")
		}
		// Verify before touching the engine's memory: a bad frame writes
		// nothing, and the round fails, so the target never resumes on it.
		if xxhash.Sum64(p) != f.sum {
			a.BadChecksum++
			a.Frames++
			a.Bytes += f.length
			if carried {
				if err := reply(ack{Credit: a.Frames}); err != nil {
					return err
				}
			}
			continue
		}
		if f.kind == frameSlots {
			if mem.Sink != nil {
				return fail("this target takes runs, not slot jobs")
			}
			if err := scatterSlots(mem, places, d, p); err != nil {
				return fail("%v", err)
			}
		} else if err := writeRuns(mem, d, p); err != nil {
			return fail("%v", err)
		}
		a.Frames++
		a.Bytes += f.length
		if carried {
			// The slot is free again: its bytes are in the engine's memory
			// (a Sink copies what it is given).
			if err := reply(ack{Credit: a.Frames}); err != nil {
				return err
			}
		}
	}
}

// writeRuns writes a runs frame into memory. Every run is checked against
// the frame and the block guard before anything is written.
func writeRuns(mem *Memory, d, p []byte) error {
	n := len(d) / runDescSize
	var total uint64
	for k := 0; k < n; k++ {
		region, at, length := readRun(d[k*runDescSize:])
		if length > uint64(len(p))-total {
			return errors.New("run outside the frame")
		}
		total += length
		if err := mem.Guard.CheckRun(region, at, length); err != nil {
			return err
		}
		if mem.Sink == nil && (int64(region) >= int64(len(mem.Data)) || at > uint64(len(mem.Data[region])) || length > uint64(len(mem.Data[region]))-at) {
			return fmt.Errorf("run outside the target regions: region %d offset %d length %d", region, at, length)
		}
	}
	if total != uint64(len(p)) {
		return fmt.Errorf("frame payload of %d bytes, runs describe %d", len(p), total)
	}
	var off uint64
	for k := 0; k < n; k++ {
		region, at, length := readRun(d[k*runDescSize:])
		if mem.Sink != nil {
			if err := mem.Sink.Write(int(region), at, p[off:off+length]); err != nil {
				return err
			}
		} else {
			copy(mem.Data[region][at:at+length], p[off:off+length])
		}
		off += length
	}
	return nil
}

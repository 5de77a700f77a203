package proxy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"strings"
	"sync"
	"time"
)

// A stream the event loop relays (evloop_linux.go) reaches its engine
// over a connection of the relay's own rather than net/http's pool, and
// its client's connection is taken from net/http's server: both sockets
// leave Go's poller for the loop's. Only plain HTTP/1.1 on both sides
// qualifies (a TLS socket's bytes are not the stream's), and the client's
// connection closes when the stream ends (Connection: close; net/http's
// server cannot take a connection back).

// Detacher is a connection whose socket can outlive its Close (the
// event loop holds a duplicate of it): Detach, called before Close,
// returns what frees the rest of what the connection held (a Host's
// connection slot), which the relay calls when it closes the socket.
type Detacher interface {
	Detach() (release func())
}

// laneStream is one stream on an event loop.
type laneStream struct {
	p        *Proxy
	s        *Stream
	up       Upstream
	st       *relayState
	watchdog *idleWatchdog
	cfd, ufd int
	raw      []byte      // the engine's bytes a read left undecoded (from the start of a chunk)
	sse      []byte      // decoded SSE bytes a read left untaken (from the start of an event)
	out      []byte      // bytes for the client not yet written
	pending  []time.Time // read times of the events in out
	data     []byte      // an event's data lines joined
	doneUp   bool        // [DONE] was taken
	// engineAddr is the engine's host:port; engineDone says its answer
	// ended exactly (its last chunk read, nothing after it): the
	// connection can carry another stream (enginePool).
	engineAddr string
	engineDone bool
	// registered: on its loop (the loop's own).
	registered bool
	ends       chan laneEnd // buffered: how the stream left its loop
}

// laneEnd is how a stream left its loop.
type laneEnd struct {
	clientGone bool // the client went away
	handBack   bool // the goroutine relay goes on with it
	cancelled  bool // ... and the engine's stream is not read any more (a fence, a cut, a cancel)
}

// laneConn is an engine connection of the relay's own.
type laneConn struct {
	conn  net.Conn
	br    *bufio.Reader
	addr  string // the engine's host:port, where it keeps the connection after the answer ("": it does not)
	taken bool   // the event loop has its socket
}

// laneBody is the body of an answer read over a laneConn: closing it
// closes the connection, unless the event loop took it.
type laneBody struct {
	io.ReadCloser
	lc   *laneConn
	stop func() bool // ends the context's watch
}

func (b *laneBody) Close() error {
	// The connection first: closing a body net/http did not make drains
	// it, which on a stream the client left would wait for its end.
	b.stop()
	if !b.lc.taken {
		b.lc.conn.Close()
	}
	_ = b.ReadCloser.Close()
	return nil
}

// laneFits says whether the event loop may relay a stream of r sent to
// baseURL.
func (p *Proxy) laneFits(r *http.Request, baseURL string, up Upstream) bool {
	// HTTP/1.1 exactly: the loop writes a chunked body, which neither an
	// HTTP/1.0 client reads nor an HTTP/2 connection carries.
	return p.loops != nil && up.Stream && r.ProtoMajor == 1 && r.ProtoMinor == 1 && r.TLS == nil && strings.HasPrefix(baseURL, "http://")
}

// do sends req: over net/http's pool, or (lane) over a connection of the
// relay's own.
func (p *Proxy) do(req *http.Request, lane bool) (*http.Response, error) {
	if !lane {
		return p.client.Do(req)
	}
	ctx := req.Context()
	// An engine connection a stream on the loop left open, where there is
	// one; one its engine closed meanwhile fails before any answer, and
	// the request goes again on a new connection (it was not taken).
	if fd, ok := p.engines.get(req.URL.Host); ok {
		if conn, err := fdConn(fd); err == nil {
			resp, err := p.send(req, conn)
			if err == nil || ctx.Err() != nil || req.GetBody == nil {
				return resp, err
			}
			if req.Body, err = req.GetBody(); err != nil {
				return nil, err
			}
		}
	}
	conn, err := p.dialer.DialContext(ctx, "tcp", req.URL.Host)
	if err != nil {
		return nil, fmt.Errorf("post %s: %w", req.URL, err)
	}
	return p.send(req, conn)
}

// send sends req over conn, a connection of the relay's own, and reads
// the answer's head.
func (p *Proxy) send(req *http.Request, conn net.Conn) (*http.Response, error) {
	ctx := req.Context()
	// Cancelling the request's context ends a read of the answer, as it
	// does on net/http's connections.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(p.upstreamTimeout))
	bw := bufio.NewWriterSize(conn, 16<<10)
	err := req.Write(bw)
	if err == nil {
		err = bw.Flush()
	}
	var resp *http.Response
	br := bufio.NewReaderSize(conn, 32<<10)
	if err == nil {
		resp, err = http.ReadResponse(br, req)
	}
	if err != nil {
		stop()
		conn.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("post %s: %w", req.URL, err)
	}
	_ = conn.SetDeadline(time.Time{})
	lc := &laneConn{conn: conn, br: br}
	if !resp.Close { // an engine that closes after answering keeps nothing for another stream
		lc.addr = req.URL.Host
	}
	resp.Body = &laneBody{ReadCloser: resp.Body, lc: lc, stop: stop}
	return resp, nil
}

// relayOnLoop relays resp's stream on an event loop, and on its goroutine
// once the loop hands it back. ok false: the stream could not go on a
// loop (nothing was written; the caller relays it).
func (p *Proxy) relayOnLoop(ctx context.Context, w http.ResponseWriter, r *http.Request, resp *http.Response, s *Stream, up Upstream) (res Result, ok bool) {
	lb, isLane := resp.Body.(*laneBody)
	if !isLane || len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" {
		return Result{}, false
	}
	h := w.Header().Clone()
	client, buffered, err := http.NewResponseController(w).Hijack()
	if err != nil {
		return Result{}, false
	}
	// The connection is served again after the stream (SetKeepAlive)
	// unless the client asked otherwise, or sent more than this request
	// already (what net/http read of it would be lost).
	keepAlive := p.keepAlive != nil && !r.Close && buffered.Reader.Buffered() == 0
	writeStreamHead(h)
	h.Del("Content-Length")
	if !keepAlive {
		h.Set("Connection", "close")
	}
	h.Set("Date", time.Now().UTC().Format(http.TimeFormat))
	var head bytes.Buffer
	head.WriteString("HTTP/1.1 200 OK\r\n")
	_ = h.Write(&head)
	head.WriteString("Transfer-Encoding: chunked\r\n\r\n")
	_ = client.SetWriteDeadline(time.Now().Add(p.writeTimeout))
	if _, err := client.Write(head.Bytes()); err != nil {
		client.Close()
		return Result{Status: StatusClientClosed}, true
	}
	_ = client.SetWriteDeadline(time.Time{})
	// The gauge falls before the client sees the stream's end, as it does
	// on the goroutine relay (net/http ends the body once it returns).
	p.m.StreamsInFlight.Inc()
	var once sync.Once
	ended := func() { once.Do(p.m.StreamsInFlight.Dec) }
	defer ended()

	st := &relayState{res: Result{Status: http.StatusOK}}
	// What the head's read took of the body goes first.
	first := make([]byte, lb.lc.br.Buffered())
	_, _ = io.ReadFull(lb.lc.br, first)
	lb.lc.taken = true
	cfd, releaseClient, cerr := dupFD(client)
	defer releaseClient() // once the client's socket is closed: the relay ends with it
	ufd, _, uerr := dupFD(lb.lc.conn)
	if cerr != nil || uerr != nil {
		// Neither socket is usable as the loop's: the client has the
		// head and nothing else; it ends as a broken stream does.
		if cerr == nil {
			closeFD(cfd)
		}
		if uerr == nil {
			closeFD(ufd)
		}
		st.res.Truncated = true
		return st.res, true
	}
	ln := &laneStream{p: p, s: s, up: up, st: st, cfd: cfd, ufd: ufd, raw: first, engineAddr: lb.lc.addr, ends: make(chan laneEnd, 1)}
	ln.watchdog = newIdleWatchdog(p.idleTimeout, s.cancelUpstream)
	loop := p.loops.pick()
	s.mu.Lock()
	cancelUp := s.cancelA
	s.cancelA = func() { cancelUp(); loop.cancel(ln) }
	s.mu.Unlock()
	if !loop.add(ln) {
		ln.ends <- laneEnd{handBack: true}
	}
	end := <-ln.ends
	if p.m.LoopStreams != nil {
		outcome := LoopDone
		switch {
		case end.handBack:
			outcome = LoopHandedBack
		case end.clientGone:
			outcome = LoopClientClosed
		}
		p.m.LoopStreams.WithLabelValues(outcome).Inc()
	}
	if !end.handBack {
		ln.watchdog.stop()
		ended()
		if !ln.engineDone || ln.engineAddr == "" || !p.engines.put(ln.engineAddr, ufd) {
			closeFD(ufd)
		}
		whole := false
		if end.clientGone {
			st.res.Status = StatusClientClosed
		} else {
			whole = writeFD(cfd, lastChunk, time.Second) == nil
		}
		if !whole || !keepAlive {
			closeFD(cfd)
			return st.res, true
		}
		conn, err := fdConn(cfd) // cfd is closed: conn holds a duplicate
		if err != nil {
			return st.res, true
		}
		releaseClient() // the connection's slot: accepted again, it takes one
		p.serveAgain(conn)
		return st.res, true
	}
	return p.relayHandedBack(ctx, ln, end, cancelUp, ended, keepAlive, releaseClient), true
}

// serveAgain hands a client connection whose response is whole to the
// server for the client's next request, or closes it.
func (p *Proxy) serveAgain(conn net.Conn) {
	_ = conn.SetDeadline(time.Time{})
	if !p.keepAlive(conn) {
		conn.Close()
	}
}

// relayHandedBack goes on with a stream its loop gave back: the goroutine
// relay over the same sockets, from where the loop was.
func (p *Proxy) relayHandedBack(ctx context.Context, ln *laneStream, end laneEnd, cancelUp context.CancelFunc, ended func(), keepAlive bool, releaseClient func()) Result {
	client, err := fdConn(ln.cfd)
	if err != nil {
		closeFD(ln.ufd)
		ln.watchdog.stop()
		ln.st.res.Status = StatusClientClosed
		return ln.st.res
	}
	cw := &connStreamWriter{conn: client, header: http.Header{}, pending: ln.out}
	// The engine's stream: what the loop had not decoded, then the
	// socket — or, cancelled, nothing more (the read fails as a cancelled
	// upstream's does, and the relay switches or fails over).
	var engine io.Reader = errReader{context.Canceled}
	cancel := cancelUp
	if end.cancelled {
		closeFD(ln.ufd)
		cancelUp()
	} else if uc, err := fdConn(ln.ufd); err != nil {
		engine = errReader{err}
	} else {
		defer uc.Close()
		engine = httputil.NewChunkedReader(io.MultiReader(bytes.NewReader(ln.raw), uc))
		cancel = func() { cancelUp(); uc.Close() }
	}
	ln.s.mu.Lock()
	ln.s.cancelA = cancel
	ln.s.mu.Unlock()
	body := io.MultiReader(bytes.NewReader(ln.sse), engine)
	res := p.relayFrom(ctx, cw, body, ln.s, ln.up, ln.st, ln.watchdog)
	ended()
	if cw.finish() != nil || !keepAlive || res.Status == StatusClientClosed {
		client.Close()
		return res
	}
	releaseClient()
	p.serveAgain(client)
	return res
}

// lastChunk ends a chunked body.
var lastChunk = []byte("0\r\n\r\n")

// errReader fails every read with err.
type errReader struct{ err error }

func (r errReader) Read([]byte) (int, error) { return 0, r.err }

// connStreamWriter is the http.ResponseWriter of a stream whose client
// connection the relay took from net/http: the head is written, each
// flush is one chunk.
type connStreamWriter struct {
	conn    net.Conn
	header  http.Header
	buf     []byte
	pending []byte // bytes (framed) the loop had not written
	err     error
}

func (w *connStreamWriter) Header() http.Header { return w.header }
func (w *connStreamWriter) WriteHeader(int)     {}

func (w *connStreamWriter) Write(b []byte) (int, error) {
	if w.err != nil {
		return 0, w.err
	}
	w.buf = append(w.buf, b...)
	return len(b), nil
}

// FlushError writes what was written since the last flush as one chunk.
func (w *connStreamWriter) FlushError() error {
	if w.err != nil {
		return w.err
	}
	if len(w.buf) > 0 {
		w.pending = fmt.Appendf(w.pending, "%x\r\n", len(w.buf))
		w.pending = append(append(w.pending, w.buf...), "\r\n"...)
		w.buf = w.buf[:0]
	}
	if len(w.pending) > 0 {
		if _, err := w.conn.Write(w.pending); err != nil {
			w.err = err
			return err
		}
		w.pending = w.pending[:0]
	}
	return nil
}

func (w *connStreamWriter) Flush() { _ = w.FlushError() }

func (w *connStreamWriter) SetWriteDeadline(t time.Time) error { return w.conn.SetWriteDeadline(t) }

// finish ends the client's chunked body.
func (w *connStreamWriter) finish() error {
	if err := w.FlushError(); err != nil {
		return err
	}
	_ = w.conn.SetWriteDeadline(time.Now().Add(time.Second))
	_, err := w.conn.Write(lastChunk)
	return err
}

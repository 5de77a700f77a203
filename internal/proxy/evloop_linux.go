//go:build linux

package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"
)

// The event loop relays a stream the way nginx does: edge-triggered epoll
// over the client's and the engine's sockets, a loop per CPU Go uses, no
// goroutine woken per event, one read (until a
// short read: the socket is drained and the next byte brings a new edge)
// and one write per batch of events. Go's poller cannot read that way —
// it reads once more into EAGAIN before it parks a goroutine — and
// parking and waking a goroutine per event is most of the rest of what
// the goroutine relay costs over nginx (docs/benchmarks.md, issue 35).
//
// A stream is on a loop only while it flows plainly: anything else — the
// stream held or cut by a migration, a fence, the engine's stream ending
// without [DONE], an idle engine, a client that stops reading — hands it,
// with the relay's state and every byte not yet relayed, back to its
// goroutine (lane.go), which goes on as the goroutine relay.

// eventLoops are the Proxy's loops.
type eventLoops struct {
	loops []*eventLoop
	next  atomic.Uint64
}

func newEventLoops(n int, log *zap.Logger) (*eventLoops, error) {
	ls := &eventLoops{}
	for i := 0; i < n; i++ {
		l, err := newEventLoop(log)
		if err != nil {
			ls.close()
			return nil, err
		}
		ls.loops = append(ls.loops, l)
		go l.run()
	}
	return ls, nil
}

func (ls *eventLoops) pick() *eventLoop {
	return ls.loops[ls.next.Add(1)%uint64(len(ls.loops))]
}

// close stops the loops; their streams go back to their goroutines.
func (ls *eventLoops) close() {
	for _, l := range ls.loops {
		l.stop()
	}
}

type eventLoop struct {
	ep, wake int
	// epFile is ep in Go's poller: an idle loop parks there, woken when
	// one of its sockets has something (an epoll descriptor is readable
	// then), like any goroutine waiting on a socket.
	epFile *os.File
	epRaw  syscall.RawConn
	log    *zap.Logger

	mu      sync.Mutex // guards what other goroutines hand the loop
	adds    []*laneStream
	cancels []*laneStream
	stopped bool

	byFD map[int32]*laneStream // the loop's own
	// The loop's buffers for one read: the engine's bytes, their chunks'
	// data, the events the client gets, and those framed.
	rbuf, sse, frame, out []byte
}

func newEventLoop(log *zap.Logger) (*eventLoop, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll: %w", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(ep)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}); err != nil {
		unix.Close(ep)
		unix.Close(wake)
		return nil, fmt.Errorf("epoll: %w", err)
	}
	if err := unix.SetNonblock(ep, true); err != nil {
		unix.Close(ep)
		unix.Close(wake)
		return nil, fmt.Errorf("epoll: %w", err)
	}
	l := &eventLoop{ep: ep, wake: wake, log: log, byFD: map[int32]*laneStream{}, rbuf: make([]byte, 64<<10)}
	l.epFile = os.NewFile(uintptr(ep), "epoll")
	if l.epRaw, err = l.epFile.SyscallConn(); err != nil {
		l.epFile.Close()
		unix.Close(wake)
		return nil, fmt.Errorf("epoll: %w", err)
	}
	return l, nil
}

// add gives the loop a stream; false when the loop stopped.
func (l *eventLoop) add(ln *laneStream) bool {
	l.mu.Lock()
	if l.stopped {
		l.mu.Unlock()
		return false
	}
	l.adds = append(l.adds, ln)
	l.mu.Unlock()
	l.poke()
	return true
}

// cancel asks the loop to stop reading ln's engine: the stream goes back
// to its goroutine, whose next read fails as a cancelled upstream's does.
func (l *eventLoop) cancel(ln *laneStream) {
	l.mu.Lock()
	l.cancels = append(l.cancels, ln)
	l.mu.Unlock()
	l.poke()
}

func (l *eventLoop) stop() {
	l.mu.Lock()
	l.stopped = true
	l.mu.Unlock()
	l.poke()
}

func (l *eventLoop) poke() {
	one := [8]byte{1}
	_, _ = unix.Write(l.wake, one[:])
}

func (l *eventLoop) run() {
	events := make([]unix.EpollEvent, 256)
	for {
		// The loop asks its epoll without blocking (a raw system call,
		// no word with Go's scheduler); with nothing ready it parks in
		// Go's poller until there is. A loop blocked in epoll_wait
		// instead holds a P in a system call, which Go's monitor (sysmon)
		// takes away after 20 µs and the loop takes back on every wake:
		// 8 % of a loaded Host's CPU. A busy loop yields between its
		// turns: Go preempts a goroutine that runs 10 ms without one,
		// which keeps that monitor waking every 20 µs too.
		var n int
		var perr error
		err := l.epRaw.Read(func(fd uintptr) bool {
			n, perr = epollPoll(int(fd), events)
			return perr != nil || n > 0
		})
		if err == nil {
			err = perr
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			l.log.Error("event loop: epoll failed; its streams go back to their goroutines", zap.Error(err))
			l.shutdown()
			return
		}
		for _, ev := range events[:n] {
			if ev.Fd == int32(l.wake) {
				if !l.drain() {
					l.shutdown()
					return
				}
				continue
			}
			ln := l.byFD[ev.Fd]
			if ln == nil {
				continue
			}
			if ev.Fd == int32(ln.cfd) {
				if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
					l.end(ln, laneEnd{clientGone: true})
					continue
				}
				l.flush(ln, nil)
				continue
			}
			l.relay(ln, true)
		}
		runtime.Gosched()
	}
}

// drain takes what other goroutines handed the loop; false: stop.
func (l *eventLoop) drain() bool {
	var b [8]byte
	_, _ = unix.Read(l.wake, b[:])
	l.mu.Lock()
	adds, cancels, stopped := l.adds, l.cancels, l.stopped
	l.adds, l.cancels = nil, nil
	l.mu.Unlock()
	for _, ln := range adds {
		l.byFD[int32(ln.cfd)], l.byFD[int32(ln.ufd)] = ln, ln
		ln.registered = true
		err := unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, ln.ufd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(ln.ufd)})
		if err == nil {
			err = unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, ln.cfd, &unix.EpollEvent{Events: unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(ln.cfd)})
		}
		if err != nil {
			l.end(ln, laneEnd{handBack: true})
			continue
		}
		l.relay(ln, true) // what came with the head, and whatever arrived since
	}
	for _, ln := range cancels {
		if ln.registered {
			l.end(ln, laneEnd{handBack: true, cancelled: true})
		}
	}
	return !stopped
}

// shutdown hands every stream back and closes the loop.
func (l *eventLoop) shutdown() {
	l.mu.Lock()
	l.stopped = true
	adds := l.adds
	l.adds = nil
	l.mu.Unlock()
	for _, ln := range adds {
		ln.ends <- laneEnd{handBack: true}
	}
	for _, ln := range l.byFD {
		if ln.registered {
			l.end(ln, laneEnd{handBack: true})
		}
	}
	l.epFile.Close()
	unix.Close(l.wake)
}

// maxLaneOut bounds what a stream's client has not taken yet: a client
// that stops reading goes back to the goroutine relay, whose write
// deadline cuts it off.
const maxLaneOut = 1 << 20

// relay reads what the engine has (read: until a read that does not fill
// the loop's buffer), and takes each read's events (take).
func (l *eventLoop) relay(ln *laneStream, read bool) {
	for {
		var data []byte
		eof, more := false, false
		if read {
			n, err := rawRead(ln.ufd, l.rbuf)
			switch {
			case n > 0:
				data, more = l.rbuf[:n], n == len(l.rbuf)
			case errors.Is(err, unix.EAGAIN):
			default:
				eof = true // the goroutine relay reads the end and decides
			}
		}
		if !l.take(ln, data, eof) || !more {
			return
		}
	}
}

// take decodes the engine's complete chunks (what ln kept of the last
// read, then data), takes their events as the goroutine relay does
// (admit), and writes what the client gets as one chunk. The loop's
// buffers hold a read's bytes; a stream keeps only what a read left
// unfinished (part of a chunk or of an event), so a thousand streams
// cost a thousand small slices, not a thousand buffers. False: the
// stream left the loop.
func (l *eventLoop) take(ln *laneStream, data []byte, eof bool) bool {
	now := time.Now()
	src := data
	if len(ln.raw) > 0 {
		ln.raw = append(ln.raw, data...)
		src = ln.raw
	}
	sse := append(l.sse[:0], ln.sse...)
	used, ended, bad, sse := decodeChunks(src, sse)
	l.sse = sse[:0]
	// The answer ended exactly: once its [DONE] is taken below, the
	// connection can carry another stream. (Its last chunk stays in raw:
	// a goroutine taking a stream that ended without [DONE] reads it.)
	ln.engineDone = ended && bytes.Equal(src[used:], lastChunk)
	if rest := src[used:]; len(ln.raw) > 0 {
		ln.raw = ln.raw[:copy(ln.raw, rest)]
	} else if len(rest) > 0 {
		ln.raw = append(ln.raw[:0], rest...)
	}
	frame := l.frame[:0] // this read's events, one chunk to the client
	handBack, cancelled := false, false
	off := 0
	for !ln.doneUp && !handBack {
		ev, n, ok, err := nextEvent(sse[off:], &ln.data)
		if err != nil {
			handBack = true // the goroutine's reader says what is wrong
			break
		}
		if !ok {
			break
		}
		ln.watchdog.saw(now)
		raw, kind, step := ln.p.admit(ln.st, ln.s, ev, now, false)
		switch step {
		case stepHeld:
			handBack = true // the goroutine waits out the hold, from this event
			continue
		case stepSkip:
			off += n
			continue
		case stepCut:
			off += n
			handBack, cancelled = true, true
			continue
		}
		off += n
		frame = append(frame, raw...)
		ln.pending = append(ln.pending, now)
		if kind == KindToken && ln.st.res.FirstToken.IsZero() {
			ln.st.res.FirstToken = now
			if ln.up.OnFirstToken != nil {
				ln.up.OnFirstToken(now)
			}
		}
		if kind == KindDone {
			ln.doneUp = true
			ln.st.res.Done = true
		}
	}
	l.frame = frame[:0]
	ln.sse = append(ln.sse[:0], sse[off:]...)
	// The engine's stream ended (or broke) before its [DONE]: the
	// goroutine relay reads that end and fails over or says so.
	handBack = handBack || (!ln.doneUp && (eof || ended || bad))
	out := l.out[:0]
	if len(frame) > 0 {
		out = strconv.AppendInt(out, int64(len(frame)), 16)
		out = append(out, "\r\n"...)
		out = append(out, frame...)
		out = append(out, "\r\n"...)
	}
	l.out = out[:0]
	if !l.flush(ln, out) {
		return false // ended
	}
	if handBack {
		l.end(ln, laneEnd{handBack: true, cancelled: cancelled})
		return false
	}
	return true
}

// flush writes to the client what it has not taken, then fresh; false
// when the stream ended (its client went away, or it is done).
func (l *eventLoop) flush(ln *laneStream, fresh []byte) bool {
	if len(ln.out) > 0 {
		ln.out = append(ln.out, fresh...)
		fresh = nil
	}
	for len(ln.out) > 0 || len(fresh) > 0 {
		b := ln.out
		if len(b) == 0 {
			b = fresh
		}
		n, err := rawWrite(ln.cfd, b)
		if n < 0 {
			n = 0
		}
		if len(ln.out) > 0 {
			ln.out = ln.out[:copy(ln.out, ln.out[n:])]
		} else {
			fresh = fresh[n:]
		}
		if errors.Is(err, unix.EAGAIN) {
			ln.out = append(ln.out, fresh...) // the client is behind: the stream keeps the rest
			if len(ln.out) > maxLaneOut {
				l.end(ln, laneEnd{handBack: true})
				return false
			}
			return true // EPOLLOUT's edge brings the loop back
		}
		if err != nil {
			l.end(ln, laneEnd{clientGone: true})
			return false
		}
	}
	if len(ln.pending) > 0 {
		now := time.Now()
		for _, t := range ln.pending {
			ln.p.m.AddedLatency.Observe(now.Sub(t).Seconds())
		}
		ln.pending = ln.pending[:0]
	}
	if ln.doneUp {
		l.end(ln, laneEnd{})
		return false
	}
	return true
}

// end takes ln off the loop and tells its goroutine how it ended.
func (l *eventLoop) end(ln *laneStream, e laneEnd) {
	if !ln.registered {
		return
	}
	ln.registered = false
	delete(l.byFD, int32(ln.cfd))
	delete(l.byFD, int32(ln.ufd))
	_ = unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, ln.ufd, nil)
	_ = unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, ln.cfd, nil)
	ln.ends <- e
}

// decodeChunks appends the data of src's complete chunks to dst: only
// whole ones, so that what is left of src starts at a chunk (a goroutine
// taking the stream reads it with a chunked reader). used: the bytes of
// src taken; ended: the last chunk came; bad: src is not chunked.
func decodeChunks(src, dst []byte) (used int, ended, bad bool, out []byte) {
	for {
		rest := src[used:]
		i := bytes.Index(rest, crlf)
		if i < 0 {
			return used, false, len(rest) > 4096, dst
		}
		sizeText := rest[:i]
		if j := bytes.IndexByte(sizeText, ';'); j >= 0 {
			sizeText = sizeText[:j]
		}
		size, err := strconv.ParseUint(string(bytes.TrimSpace(sizeText)), 16, 31)
		if err != nil {
			return used, false, true, dst
		}
		if size == 0 {
			return used, true, false, dst // the engine's body ended: the goroutine reads the rest
		}
		end := i + 2 + int(size) + 2
		if len(rest) < end {
			return used, false, false, dst
		}
		if !bytes.Equal(rest[end-2:end], crlf) {
			return used, false, true, dst
		}
		dst = append(dst, rest[i+2:i+2+int(size)]...)
		used += end
	}
}

var crlf = []byte("\r\n")

// nextEvent is the first whole SSE event in b, as EventReader.Next reads
// it (n: the bytes it took, stray blank lines before it included); ok
// false: no whole event yet. An event's Data of several lines is joined
// in *scratch.
func nextEvent(b []byte, scratch *[]byte) (ev Event, n int, ok bool, err error) {
	start, pos := 0, 0
	var data []byte
	lines, hasData := 0, false
	for {
		i := bytes.IndexByte(b[pos:], '\n')
		if i < 0 {
			if len(b)-start > maxEventBytes {
				return Event{}, 0, false, ErrEventTooLarge
			}
			return Event{}, 0, false, nil
		}
		line := b[pos : pos+i+1]
		pos += i + 1
		content := bytes.TrimRight(line, "\r\n")
		if len(content) == 0 {
			if pos-len(line) == start {
				start = pos // a stray blank line between events
				continue
			}
			ev = Event{Raw: b[start:pos]}
			if hasData {
				ev.Data = data
			}
			return ev, pos, true, nil
		}
		if v, found := bytes.CutPrefix(content, []byte("data:")); found {
			v = bytes.TrimPrefix(v, []byte(" "))
			switch lines {
			case 0:
				data = v
			case 1:
				*scratch = append(append(append((*scratch)[:0], data...), '\n'), v...)
				data = *scratch
			default:
				*scratch = append(append(*scratch, '\n'), v...)
				data = *scratch
			}
			lines++
			hasData = true
		}
	}
}

// dupFD takes a connection's socket out of Go's poller: a duplicate of
// its descriptor, non-blocking, the connection closed (which removes the
// original from the poller). release frees what the connection held
// besides its socket (Detacher), once the duplicate is closed.
func dupFD(c net.Conn) (fd int, release func(), err error) {
	release = func() {}
	sc, ok := c.(syscall.Conn)
	if !ok {
		c.Close()
		return -1, release, fmt.Errorf("a %T has no descriptor", c)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		c.Close()
		return -1, release, err
	}
	var derr error
	if err := rc.Control(func(f uintptr) { fd, derr = unix.Dup(int(f)) }); err != nil {
		c.Close()
		return -1, release, err
	}
	if derr != nil {
		c.Close()
		return -1, release, derr
	}
	if d, ok := c.(Detacher); ok {
		release = d.Detach()
	}
	c.Close()
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		release()
		return -1, func() {}, err
	}
	return fd, release, nil
}

// fdConn is a net.Conn of a descriptor the loop gave back (Go's poller
// takes a duplicate; fd is closed).
func fdConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "relay")
	defer f.Close()
	return net.FileConn(f)
}

func closeFD(fd int) { _ = unix.Close(fd) }

// idleAlive says whether an idle connection's peer still keeps it:
// nothing to read on it (a peer that closed it, or sent something
// unasked, makes it readable).
func idleAlive(fd int) bool {
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n == 0
}

// The loop's reads, writes and polls never block (its sockets are
// non-blocking): made as raw system calls, they cost no entry to and exit
// from Go's scheduler, which a blocking call needs so that its P can serve
// other goroutines meanwhile.

func rawRead(fd int, p []byte) (int, error) { return rawIO(unix.SYS_READ, fd, p) }

func rawWrite(fd int, p []byte) (int, error) { return rawIO(unix.SYS_WRITE, fd, p) }

func rawIO(trap uintptr, fd int, p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	n, _, e := unix.RawSyscall(trap, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// epollPoll is epoll_wait that returns at once.
func epollPoll(ep int, events []unix.EpollEvent) (int, error) {
	n, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(ep), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), 0, 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(n), nil
}

// writeFD writes b whole to the non-blocking socket fd, waiting up to
// timeout for room.
func writeFD(fd int, b []byte, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for len(b) > 0 {
		n, err := unix.Write(fd, b)
		if n > 0 {
			b = b[n:]
		}
		switch {
		case errors.Is(err, unix.EAGAIN):
			left := time.Until(deadline)
			if left <= 0 {
				return os.ErrDeadlineExceeded
			}
			_, _ = unix.Poll([]unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}, int(left.Milliseconds())+1)
		case err != nil:
			return err
		}
	}
	return nil
}

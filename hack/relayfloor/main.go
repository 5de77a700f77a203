// Command relayfloor is an experiment, not part of vhi: the least a Go
// SSE relay built the way nginx is (edge-triggered epoll, one loop per
// core, no goroutine per stream, one read and one write per event) costs
// per event, to tell whether the Host's relay can reach nginx's CPU per
// event in Go at all (issue 35). It relays POSTs to one upstream and
// re-chunks the upstream's chunked SSE body to the client, classifying
// each event as the Host does (a token event's text length), and nothing
// else: no failover, no splice, no metrics, no TLS. `vhi bench proxy
// --extra-proxy` runs it beside the Host and nginx.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8099", "listen address")
	upstream := flag.String("upstream", "127.0.0.1:8000", "upstream host:port")
	loopsN := flag.Int("loops", runtime.GOMAXPROCS(0), "event loops")
	profile := flag.String("cpuprofile", "", "write a CPU profile here until SIGTERM")
	flag.Parse()
	if *profile != "" {
		f, err := os.Create(*profile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		go func() { <-sig; pprof.StopCPUProfile(); f.Close(); os.Exit(0) }()
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	loops := make([]*loop, *loopsN)
	for i := range loops {
		if loops[i], err = newLoop(); err != nil {
			log.Fatal(err)
		}
		go loops[i].run()
	}
	var next atomic.Uint64
	for {
		c, err := ln.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go handle(c, *upstream, loops[next.Add(1)%uint64(len(loops))])
	}
}

// handle reads the client's request, sends it upstream, reads the
// response head, and hands both sockets to the loop.
func handle(c net.Conn, upstream string, l *loop) {
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		c.Close()
		return
	}
	if req.URL.Path == "/health" {
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
		c.Close()
		return
	}
	body, _ := io.ReadAll(req.Body)
	up, err := net.Dial("tcp", upstream)
	if err != nil {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		c.Close()
		return
	}
	var head bytes.Buffer
	fmt.Fprintf(&head, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", req.URL.RequestURI(), upstream, len(body))
	head.Write(body)
	if _, err := up.Write(head.Bytes()); err != nil {
		c.Close()
		up.Close()
		return
	}
	ubr := bufio.NewReaderSize(up, 64<<10)
	resp, err := http.ReadResponse(ubr, req)
	if err != nil || resp.StatusCode != 200 || len(resp.TransferEncoding) == 0 {
		io.WriteString(c, "HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
		c.Close()
		up.Close()
		return
	}
	// What the head's read buffered of the body goes first.
	left := make([]byte, ubr.Buffered())
	ubr.Read(left)
	io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nCache-Control: no-cache\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
	cfd, err1 := dupClose(c)
	ufd, err2 := dupClose(up)
	if err1 != nil || err2 != nil {
		return
	}
	l.add(&pair{cfd: cfd, ufd: ufd, in: append(make([]byte, 0, 64<<10), left...)})
}

// dupClose takes the socket out of Go's poller: a duplicate of its fd,
// the original closed (which deregisters it).
func dupClose(c net.Conn) (int, error) {
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		return -1, err
	}
	fd := -1
	var derr error
	if err := rc.Control(func(f uintptr) { fd, derr = unix.Dup(int(f)) }); err != nil {
		return -1, err
	}
	c.Close()
	if derr != nil {
		return -1, derr
	}
	return fd, unix.SetNonblock(fd, true)
}

// pair is one stream: the client's socket and the upstream's.
type pair struct {
	cfd, ufd int
	in       []byte // upstream bytes not yet parsed
	out      []byte // client bytes not yet written
	done     bool   // the last chunk was seen
	tokens   int
}

type loop struct {
	ep, wake int
	mu       sync.Mutex
	pending  []*pair
	byFD     map[int]*pair
}

func newLoop() (*loop, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	wake, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		return nil, err
	}
	l := &loop{ep: ep, wake: wake, byFD: map[int]*pair{}}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}); err != nil {
		return nil, err
	}
	return l, nil
}

func (l *loop) add(p *pair) {
	l.mu.Lock()
	l.pending = append(l.pending, p)
	l.mu.Unlock()
	var one = [8]byte{1}
	unix.Write(l.wake, one[:])
}

func (l *loop) run() {
	runtime.LockOSThread()
	events := make([]unix.EpollEvent, 256)
	for {
		n, err := unix.EpollWait(l.ep, events, -1)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			log.Fatal(err)
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if fd == l.wake {
				var b [8]byte
				unix.Read(l.wake, b[:])
				l.mu.Lock()
				ps := l.pending
				l.pending = nil
				l.mu.Unlock()
				for _, p := range ps {
					l.byFD[p.cfd], l.byFD[p.ufd] = p, p
					unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, p.ufd, &unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(p.ufd)})
					unix.EpollCtl(l.ep, unix.EPOLL_CTL_ADD, p.cfd, &unix.EpollEvent{Events: unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(p.cfd)})
					l.relay(p, false)
				}
				continue
			}
			p := l.byFD[fd]
			if p == nil {
				continue
			}
			if fd == p.cfd {
				if ev.Events&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
					l.close(p)
					continue
				}
				l.flush(p)
				continue
			}
			l.relay(p, true)
		}
	}
}

// relay reads what the upstream has (until a short read: the socket is
// drained, and the next byte brings a new edge), re-chunks each complete
// chunk's events for the client, and writes them in one call.
func (l *loop) relay(p *pair, read bool) {
	eof := false
	for read {
		if cap(p.in)-len(p.in) < 16<<10 {
			p.in = append(p.in, make([]byte, 64<<10)...)[:len(p.in)]
		}
		space := p.in[len(p.in):cap(p.in)]
		n, err := unix.Read(p.ufd, space)
		if n > 0 {
			p.in = p.in[:len(p.in)+n]
		}
		if err == unix.EAGAIN || (err == nil && n > 0 && n < len(space)) {
			break
		}
		if err != nil || n == 0 {
			eof = true
			break
		}
	}
	in := p.in
	for !p.done {
		i := bytes.Index(in, crlf)
		if i < 0 {
			break
		}
		size, err := strconv.ParseUint(string(bytes.TrimSpace(in[:i])), 16, 32)
		if err != nil {
			eof = true
			break
		}
		if size == 0 {
			p.done = true
			p.out = append(p.out, "0\r\n\r\n"...)
			in = in[len(in):]
			break
		}
		if len(in) < i+2+int(size)+2 {
			break
		}
		data := in[i+2 : i+2+int(size)]
		classify(p, data)
		p.out = strconv.AppendUint(p.out, size, 16)
		p.out = append(p.out, crlf...)
		p.out = append(p.out, data...)
		p.out = append(p.out, crlf...)
		in = in[i+2+int(size)+2:]
	}
	p.in = p.in[:copy(p.in, in)]
	l.flush(p)
	if eof && !p.done {
		l.close(p)
	}
}

var crlf = []byte("\r\n")
var textKey = []byte(`"text":"`)

// classify does the Host's per-event reading: each event's kind and its
// text's length.
func classify(p *pair, data []byte) {
	for len(data) > 0 {
		i := bytes.Index(data, []byte("\n\n"))
		ev := data
		if i >= 0 {
			ev, data = data[:i], data[i+2:]
		} else {
			data = nil
		}
		if j := bytes.Index(ev, textKey); j >= 0 {
			if k := bytes.IndexByte(ev[j+len(textKey):], '"'); k >= 0 {
				p.tokens++
			}
		}
	}
}

func (l *loop) flush(p *pair) {
	for len(p.out) > 0 {
		n, err := unix.Write(p.cfd, p.out)
		if n > 0 {
			p.out = p.out[:copy(p.out, p.out[n:])]
		}
		if err == unix.EAGAIN {
			return // EPOLLOUT's edge brings us back
		}
		if err != nil {
			l.close(p)
			return
		}
	}
	if p.done {
		l.close(p)
	}
}

func (l *loop) close(p *pair) {
	if l.byFD[p.cfd] != p {
		return
	}
	delete(l.byFD, p.cfd)
	delete(l.byFD, p.ufd)
	unix.Close(p.cfd)
	unix.Close(p.ufd)
}

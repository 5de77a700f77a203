package tcpshm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef")

func memoryOf(g kvlayout.Geometry, p kvlayout.Parallel, fill bool) *Memory {
	m := &Memory{Layers: g.Layers, Heads: g.KVHeads, SlotBytes: int64(g.HeadSlotBytes())}
	rng := rand.New(rand.NewPCG(7, 9))
	for _, sh := range kvlayout.Shards(p) {
		r := kvlayout.NewRegionLayout(g, sh)
		b := make([]byte, r.Size())
		if fill {
			for i := range b {
				b[i] = byte(rng.IntN(256))
			}
		}
		m.Data = append(m.Data, b)
		m.Specs = append(m.Specs, r.Spec())
	}
	return m
}

// guard lets writes reach blocks of m.
func guard(t testing.TB, g kvlayout.Geometry, m *Memory, blocks ...int) *kvlayout.BlockGuard {
	t.Helper()
	gd, err := m.GuardBlocks(g, blocks)
	if err != nil {
		t.Fatal(err)
	}
	return gd
}

// serveMemory runs a data server holding session "mig-1" for dst.
func serveMemory(t testing.TB, dst *Memory, expires time.Time, opt Options) *Server {
	t.Helper()
	srv, err := Listen("127.0.0.1:0", func(s string) (*Session, error) {
		if s != "mig-1" {
			return nil, fmt.Errorf("no migration %q is expected here", s)
		}
		return &Session{Secret: testSecret, Expires: expires, Open: func() (*Memory, error) { return dst, nil }}, nil
	}, opt, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

func dest(srv *Server) Dest {
	return Dest{Addr: srv.Addr().String(), Session: "mig-1", Secret: testSecret}
}

// readSlot returns the bytes of (layer, kv, head, block, slot) wherever the
// layout keeps them.
func readSlot(m *Memory, l, kv, h, b, s int) []byte {
	if v := m.Slot(l, kv, h, b, s); v != nil {
		return v
	}
	panic("not held")
}

var testGeo = kvlayout.Geometry{Layers: 4, KVHeads: 4, HeadDim: 4, DTypeBytes: 2, BlockSize: 8, NumBlocks: 32}

// Runs and slot jobs both land exactly, across TP shapes, over several
// connections; a corrupted frame is reported and a cut connection fails.
func TestSendRunsAndSlots(t *testing.T) {
	g := testGeo
	src := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, true)
	for _, dp := range []kvlayout.Parallel{{TP: 1, PP: 1}, {TP: 2, PP: 2}} {
		for _, slots := range []bool{false, true} {
			t.Run(fmt.Sprintf("tp%d-pp%d-slots=%v", dp.TP, dp.PP, slots), func(t *testing.T) {
				dst := memoryOf(g, dp, false)
				dst.Guard = guard(t, g, dst, 1, 5, 6)
				srv := serveMemory(t, dst, time.Now().Add(time.Minute), Options{})
				copies := []kvlayout.BlockCopy{{Src: 3, Dst: 5, FirstSlot: 2, NumSlots: 3}, {Src: 4, Dst: 6, NumSlots: 8}, {Src: 9, Dst: 1, FirstSlot: 7, NumSlots: 1}}
				var err error
				if slots {
					_, err = SendSlots(context.Background(), dest(srv), 3, src, copies, transfer.NoFault)
				} else {
					runs, perr := kvlayout.Plan(g.Layers, g.KVHeads, src.SlotBytes, src.Specs, dst.Specs, copies)
					if perr != nil {
						t.Fatal(perr)
					}
					_, err = Send(context.Background(), dest(srv), 3, src.Data, runs, transfer.NoFault)
				}
				if err != nil {
					t.Fatal(err)
				}
				for _, c := range copies {
					for l := 0; l < g.Layers; l++ {
						for kv := 0; kv < 2; kv++ {
							for h := 0; h < g.KVHeads; h++ {
								for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
									if !bytes.Equal(readSlot(dst, l, kv, h, c.Dst, s), readSlot(src, l, kv, h, c.Src, s)) {
										t.Fatalf("layer %d kv %d head %d block %d slot %d differs", l, kv, h, c.Dst, s)
									}
								}
							}
						}
					}
				}
				// Faults are detected, never silently accepted.
				if _, err := SendSlots(context.Background(), dest(srv), 1, src, copies, transfer.CorruptFrame); err == nil {
					t.Fatal("a corrupted frame was accepted")
				}
				if _, err := SendSlots(context.Background(), dest(srv), 1, src, copies, transfer.CutConn); err == nil {
					t.Fatal("a cut connection reported success")
				}
				other := dest(srv)
				other.Session = "other"
				if _, err := SendSlots(context.Background(), other, 1, src, copies, transfer.NoFault); err == nil {
					t.Fatal("an unexpected session was accepted")
				}
			})
		}
	}
}

// Nothing lands without the migration's secret, after the session
// expired, or outside the blocks reserved for the migration.
func TestTargetRefuses(t *testing.T) {
	g := testGeo
	src := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, true)
	dst := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, false)
	dst.Guard = guard(t, g, dst, 5)
	srv := serveMemory(t, dst, time.Now().Add(time.Minute), Options{})
	ok := []kvlayout.BlockCopy{{Src: 3, Dst: 5, NumSlots: 8}}
	cases := []struct {
		name   string
		d      Dest
		copies []kvlayout.BlockCopy
		want   string
	}{
		{"wrong secret", Dest{Addr: srv.Addr().String(), Session: "mig-1", Secret: []byte("not the secret, not at all")}, ok, "authentication failed"},
		{"no secret", Dest{Addr: srv.Addr().String(), Session: "mig-1"}, ok, "authentication failed"},
		{"block not reserved", dest(srv), []kvlayout.BlockCopy{{Src: 3, Dst: 6, NumSlots: 8}}, "not reserved"},
		{"slots past the block", dest(srv), []kvlayout.BlockCopy{{Src: 3, Dst: 5, FirstSlot: 6, NumSlots: 4}}, "outside a block|not reserved"},
	}
	for _, c := range cases {
		for _, slots := range []bool{false, true} {
			var err error
			if slots {
				_, err = SendSlots(context.Background(), c.d, 1, src, c.copies, transfer.NoFault)
			} else {
				runs, perr := kvlayout.Plan(g.Layers, g.KVHeads, src.SlotBytes, src.Specs, dst.Specs, c.copies)
				if perr != nil {
					t.Fatal(perr)
				}
				_, err = Send(context.Background(), c.d, 1, src.Data, runs, transfer.NoFault)
			}
			if err == nil || !containsAny(err.Error(), strings.Split(c.want, "|")) {
				t.Errorf("%s (slots=%v): %v, want %q", c.name, slots, err, c.want)
			}
		}
	}
	for i, b := range dst.Data[0] {
		if b != 0 {
			t.Fatalf("byte %d of the target changed", i)
		}
	}
	expired := serveMemory(t, dst, time.Now().Add(-time.Second), Options{})
	if _, err := SendSlots(context.Background(), dest(expired), 1, src, ok, transfer.NoFault); err == nil || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("an expired session: %v", err)
	}
}

// The source refuses to send to a listener that cannot prove it holds the
// migration's secret.
func TestSourceRefusesAnImpostor(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		br := bufio.NewReader(c)
		_, _ = br.ReadString('\n') // magic
		_, _ = br.ReadString('\n') // hello
		_ = writeLine(c, challengeMsg{Nonce: nonce()})
		_, _ = br.ReadString('\n') // the client's proof
		_ = writeLine(c, proofMsg{Proof: []byte("made up, without the secret....")})
		_, _ = br.ReadString('\n')
	}()
	src := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, true)
	_, err = SendSlots(context.Background(), Dest{Addr: ln.Addr().String(), Session: "mig-1", Secret: testSecret}, 1, src,
		[]kvlayout.BlockCopy{{Src: 1, Dst: 1, NumSlots: 1}}, transfer.NoFault)
	if err == nil || !strings.Contains(err.Error(), "does not hold") {
		t.Fatalf("sent KV to an impostor: %v", err)
	}
}

// authenticatedConn opens a connection to srv and authenticates it.
func authenticatedConn(t testing.TB, srv *Server) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", srv.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	br, err := clientHandshake(c, "mig-1", testSecret, "")
	if err != nil {
		c.Close()
		t.Fatal(err)
	}
	return c, br
}

func rawRunsFrame(region uint32, at, n uint64, payload []byte) []byte {
	var hdr [frameHdrSize]byte
	frameHeader{runs: 1, kind: frameRuns, length: uint64(len(payload)), sum: xxhash.Sum64(payload)}.put(hdr[:])
	var d [runDescSize]byte
	binary.LittleEndian.PutUint32(d[0:], region)
	binary.LittleEndian.PutUint64(d[4:], at)
	binary.LittleEndian.PutUint64(d[12:], n)
	return append(append(hdr[:], d[:]...), payload...)
}

// A hostile but authenticated frame (offsets that wrap around uint64, runs
// longer than the frame) is refused with an error, never a panic.
func TestHostileFrames(t *testing.T) {
	dst := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, false)
	dst.Guard = guard(t, testGeo, dst, 5)
	srv := serveMemory(t, dst, time.Now().Add(time.Minute), Options{})
	for _, f := range [][]byte{
		rawRunsFrame(0, math.MaxUint64, 1, []byte{1}),
		rawRunsFrame(0, 0, math.MaxUint64, []byte{1}),
		rawRunsFrame(7, 0, 1, []byte{1}),
		rawRunsFrame(0, 0, 2, []byte{1}),
	} {
		c, br := authenticatedConn(t, srv)
		if _, err := c.Write(f); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		line, _ := br.ReadString('\n')
		if !strings.Contains(line, "error") {
			t.Fatalf("hostile frame answered %q", line)
		}
		c.Close()
	}
}

// Peers that never authenticate get almost nothing: beyond MaxHandshakes
// they are closed at once, and the others are cut at the handshake
// timeout; an authenticated source still gets through afterwards.
func TestIdleConnectionsAreBounded(t *testing.T) {
	dst := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, false)
	dst.Guard = guard(t, testGeo, dst, 5)
	srv := serveMemory(t, dst, time.Now().Add(time.Minute), Options{MaxHandshakes: 4, HandshakeTimeout: 300 * time.Millisecond})
	var idle []net.Conn
	for i := 0; i < 50; i++ {
		c, err := net.Dial("tcp", srv.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	var wg sync.WaitGroup
	closed := 0
	var mu sync.Mutex
	for _, c := range idle {
		wg.Add(1)
		go func(c net.Conn) {
			defer wg.Done()
			_ = c.SetReadDeadline(time.Now().Add(3 * time.Second))
			if _, err := c.Read(make([]byte, 1)); err != nil {
				if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
					mu.Lock()
					closed++
					mu.Unlock()
				}
			}
			c.Close()
		}(c)
	}
	wg.Wait()
	if closed != len(idle) {
		t.Fatalf("%d of %d idle connections were closed by the target", closed, len(idle))
	}
	src := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, true)
	if _, err := SendSlots(context.Background(), dest(srv), 1, src, []kvlayout.BlockCopy{{Src: 1, Dst: 5, NumSlots: 8}}, transfer.NoFault); err != nil {
		t.Fatal(err)
	}
}

// FuzzFrames feeds arbitrary bytes after an authenticated handshake: the
// target never panics and never writes outside the one reserved block.
func FuzzFrames(f *testing.F) {
	g := kvlayout.Geometry{Layers: 2, KVHeads: 2, HeadDim: 4, DTypeBytes: 2, BlockSize: 4, NumBlocks: 8}
	l := kvlayout.NewRegionLayout(g, kvlayout.Shard{TPSize: 1, PPSize: 1})
	f.Add(rawRunsFrame(0, uint64(l.Offset(0, 0, 3, 0, 0)), 4, []byte{1, 2, 3, 4}))
	f.Add(rawRunsFrame(0, math.MaxUint64, 1, []byte{1}))
	var jobs [frameHdrSize + jobSize]byte
	frameHeader{runs: 1, kind: frameSlots, length: 0}.put(jobs[:])
	f.Add(jobs[:])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, frames []byte) {
		dst := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, false)
		dst.Guard = guard(t, g, dst, 3)
		srv, err := Listen("127.0.0.1:0", func(string) (*Session, error) {
			return &Session{Secret: testSecret, Expires: time.Now().Add(time.Hour), Open: func() (*Memory, error) { return dst, nil }}, nil
		}, Options{IdleTimeout: 200 * time.Millisecond}, zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		c, br := authenticatedConn(t, srv)
		_, _ = c.Write(frames)
		// Half-close: the target sees the end of the bytes at once instead
		// of waiting out its idle timeout for frames that never come.
		_ = c.(*net.TCPConn).CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, _ = br.ReadString('\n')
		c.Close()
		srv.Close() // waits for the connection's handler: its writes are done
		for i, b := range dst.Data[0] {
			if b == 0 {
				continue
			}
			off := int64(i)
			if blk := (off % l.KVStride()) / l.BlockStride(); blk != 3 {
				t.Fatalf("byte %d (block %d) was written", i, blk)
			}
		}
	})
}

func containsAny(s string, subs []string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// slowSink takes its writes into memory and takes its time to flush, as a
// GPU target on a busy machine may.
type slowSink struct {
	mem   *Memory
	delay time.Duration
}

func (s slowSink) Write(region int, at uint64, b []byte) error {
	copy(s.mem.Data[region][at:], b)
	return nil
}

func (s slowSink) Flush() error {
	time.Sleep(s.delay)
	return nil
}

// A round that outlasts the handshake's deadline is still acknowledged:
// the handshake's deadline must not bound the round (a full round 0 of a
// busy engine took longer than it, and the answer's write timed out).
func TestRoundsOutlastTheHandshakeDeadline(t *testing.T) {
	g := testGeo
	src := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, true)
	dst := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, false)
	dst.Guard = guard(t, g, dst, 2)
	dst.Sink = slowSink{mem: dst, delay: 600 * time.Millisecond}
	srv := serveMemory(t, dst, time.Now().Add(time.Minute), Options{HandshakeTimeout: 200 * time.Millisecond})
	copies := []kvlayout.BlockCopy{{Src: 3, Dst: 2, NumSlots: g.BlockSize}}
	runs, err := kvlayout.Plan(g.Layers, g.KVHeads, src.SlotBytes, src.Specs, dst.Specs, copies)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Send(context.Background(), dest(srv), 1, src.Data, runs, transfer.NoFault); err != nil {
		t.Fatalf("a round slower than the handshake deadline failed: %v", err)
	}
	if !bytes.Equal(readSlot(dst, 1, 1, 2, 2, 3), readSlot(src, 1, 1, 2, 3, 3)) {
		t.Fatal("the round's bytes did not land")
	}
}

// takes records what a paced round took.
type takes struct {
	mu    sync.Mutex
	n     []int64
	total int64
}

func (p *takes) Take(_ context.Context, n int64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.n = append(p.n, n)
	p.total += n
	return nil
}

// A paced round takes every byte it sends from its pacer, frame by frame
// (none over pacedFrame), and lands exactly as an unpaced one.
func TestAPacedRoundTakesEveryFramesBytes(t *testing.T) {
	g := testGeo
	src := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, true)
	for _, slots := range []bool{false, true} {
		dst := memoryOf(g, kvlayout.Parallel{TP: 1, PP: 1}, false)
		dst.Guard = guard(t, g, dst, 1, 5, 6)
		srv := serveMemory(t, dst, time.Now().Add(time.Minute), Options{})
		copies := []kvlayout.BlockCopy{{Src: 3, Dst: 5, FirstSlot: 2, NumSlots: 3}, {Src: 4, Dst: 6, NumSlots: 8}, {Src: 9, Dst: 1, FirstSlot: 7, NumSlots: 1}}
		p := &takes{}
		d := dest(srv)
		d.Pace = p
		var st transfer.Stats
		var err error
		if slots {
			st, err = SendSlots(context.Background(), d, 2, src, copies, transfer.NoFault)
		} else {
			runs, perr := kvlayout.Plan(g.Layers, g.KVHeads, src.SlotBytes, src.Specs, dst.Specs, copies)
			if perr != nil {
				t.Fatal(perr)
			}
			st, err = Send(context.Background(), d, 2, src.Data, runs, transfer.NoFault)
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(p.n) == 0 || p.total < st.Bytes {
			t.Fatalf("slots=%v: the pacer gave %d bytes in %d takes; the round sent %d", slots, p.total, len(p.n), st.Bytes)
		}
		for _, n := range p.n {
			if n > pacedFrame {
				t.Fatalf("a paced frame of %d bytes (over %d)", n, pacedFrame)
			}
		}
		for _, c := range copies {
			for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
				if !bytes.Equal(readSlot(dst, 1, 1, 2, c.Dst, s), readSlot(src, 1, 1, 2, c.Src, s)) {
					t.Fatalf("slots=%v: block %d slot %d differs", slots, c.Dst, s)
				}
			}
		}
	}
}

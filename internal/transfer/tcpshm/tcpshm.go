// Package tcpshm is the tcp_shm data plane: the source agent reads the
// engine's shared memory and streams copy runs over several TCP
// connections; the target agent writes them straight into its engine's
// shared memory. Every frame carries an xxhash64 of its bytes, checked on
// arrival; a round succeeds only when the target acknowledged every frame
// with a matching checksum.
package tcpshm

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// Type is the backend's name.
const Type = "tcp_shm"

// maxFrame bounds one frame's payload; longer runs are split so several
// connections share the work.
const maxFrame = 4 << 20

const (
	magic        = "VHI-TCPSHM/1\n"
	frameHdrSize = 32
	endRegion    = ^uint32(0)
)

// hello opens a connection.
type hello struct {
	Session string `json:"session"` // the migration id: the target checks it expects it
}

type frameHeader struct {
	region uint32
	offset uint64
	length uint64
	sum    uint64
}

func (h frameHeader) put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], h.region)
	binary.LittleEndian.PutUint32(b[4:], 0)
	binary.LittleEndian.PutUint64(b[8:], h.offset)
	binary.LittleEndian.PutUint64(b[16:], h.length)
	binary.LittleEndian.PutUint64(b[24:], h.sum)
}

func readHeader(b []byte) frameHeader {
	return frameHeader{
		region: binary.LittleEndian.Uint32(b[0:]), offset: binary.LittleEndian.Uint64(b[8:]),
		length: binary.LittleEndian.Uint64(b[16:]), sum: binary.LittleEndian.Uint64(b[24:]),
	}
}

// ack is the target's answer to an end frame.
type ack struct {
	Frames      uint64 `json:"frames"`
	Bytes       uint64 `json:"bytes"`
	BadChecksum uint64 `json:"bad_checksum"`
	Error       string `json:"error,omitempty"`
}

// Fault injects a failure into a send, for tests of the abort paths.
type Fault int

// Faults.
const (
	NoFault      Fault = iota
	CorruptFrame       // flip a byte after checksumming: the target must notice
	CutConn            // close a connection mid-round
)

// Stats describe one send.
type Stats struct {
	Runs     int
	Frames   int
	Bytes    int64
	Duration time.Duration
}

// Send copies runs from src (mapped source regions) to the target data
// server at addr over tn connections.
func Send(ctx context.Context, addr, session string, tn int, src [][]byte, runs []kvlayout.CopyRun, fault Fault) (Stats, error) {
	start := time.Now()
	if tn < 1 {
		tn = 1
	}
	// Split into frames and share them out by bytes.
	shares := make([][]kvlayout.CopyRun, tn)
	load := make([]int64, tn)
	nframes := 0
	for _, r := range runs {
		if r.SrcRegion < 0 || r.SrcRegion >= len(src) || r.SrcOffset < 0 || r.SrcOffset+r.Length > int64(len(src[r.SrcRegion])) {
			return Stats{}, fmt.Errorf("tcp_shm: run %+v outside the source regions", r)
		}
		for off := int64(0); off < r.Length; off += maxFrame {
			n := min(maxFrame, r.Length-off)
			i := 0
			for j := range load {
				if load[j] < load[i] {
					i = j
				}
			}
			shares[i] = append(shares[i], kvlayout.CopyRun{SrcRegion: r.SrcRegion, SrcOffset: r.SrcOffset + off, DstRegion: r.DstRegion, DstOffset: r.DstOffset + off, Length: n})
			load[i] += n
			nframes++
		}
	}
	var wg sync.WaitGroup
	errs := make([]error, tn)
	for i := range shares {
		if len(shares[i]) == 0 && i > 0 {
			continue
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			f := NoFault
			if i == 0 {
				f = fault
			}
			errs[i] = sendConn(ctx, addr, session, src, shares[i], f)
		}(i)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return Stats{}, err
	}
	return Stats{Runs: len(runs), Frames: nframes, Bytes: kvlayout.Bytes(runs), Duration: time.Since(start)}, nil
}

func sendConn(ctx context.Context, addr, session string, src [][]byte, frames []kvlayout.CopyRun, fault Fault) error {
	d := net.Dialer{Timeout: 5 * time.Second}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("tcp_shm: dial %s: %w", addr, err)
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	w := bufio.NewWriterSize(conn, 1<<20)
	hb, _ := json.Marshal(hello{Session: session})
	if _, err := w.WriteString(magic + string(hb) + "\n"); err != nil {
		return err
	}
	var hdr [frameHdrSize]byte
	buf := make([]byte, 0, maxFrame)
	var sent, bytes uint64
	for i, f := range frames {
		if fault == CutConn && i == len(frames)/2 {
			_ = w.Flush()
			return fmt.Errorf("tcp_shm: injected fault: connection cut after %d of %d frames", i, len(frames))
		}
		// Snapshot the bytes first: a non-final round reads memory the
		// engine may be writing, and the checksum must match what is sent.
		buf = append(buf[:0], src[f.SrcRegion][f.SrcOffset:f.SrcOffset+f.Length]...)
		sum := xxhash.Sum64(buf)
		if fault == CorruptFrame && i == 0 {
			buf[0] ^= 0xFF
		}
		frameHeader{region: uint32(f.DstRegion), offset: uint64(f.DstOffset), length: uint64(f.Length), sum: sum}.put(hdr[:])
		if _, err := w.Write(hdr[:]); err != nil {
			return fmt.Errorf("tcp_shm: send: %w", err)
		}
		if _, err := w.Write(buf); err != nil {
			return fmt.Errorf("tcp_shm: send: %w", err)
		}
		sent++
		bytes += uint64(f.Length)
	}
	frameHeader{region: endRegion}.put(hdr[:])
	if _, err := w.Write(hdr[:]); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("tcp_shm: send: %w", err)
	}
	var a ack
	if err := json.NewDecoder(bufio.NewReader(conn)).Decode(&a); err != nil {
		return fmt.Errorf("tcp_shm: no acknowledgement from the target: %w", err)
	}
	switch {
	case a.Error != "":
		return fmt.Errorf("tcp_shm: target: %s", a.Error)
	case a.BadChecksum > 0:
		return fmt.Errorf("tcp_shm: target found %d frames with a bad checksum", a.BadChecksum)
	case a.Frames != sent || a.Bytes != bytes:
		return fmt.Errorf("tcp_shm: target acknowledged %d frames / %d bytes, sent %d / %d", a.Frames, a.Bytes, sent, bytes)
	}
	return nil
}

// Target resolves the regions a session writes into; nil refuses it.
type Target func(session string) ([][]byte, error)

// Server is the target side: it accepts data connections and writes frames
// into the regions its Target resolves.
type Server struct {
	ln     net.Listener
	target Target
	log    *zap.Logger
	wg     sync.WaitGroup
}

// Listen starts a data server on addr.
func Listen(addr string, target Target, log *zap.Logger) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcp_shm: listen %s: %w", addr, err)
	}
	s := &Server{ln: ln, target: target, log: log}
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
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			if err := s.serve(c); err != nil {
				s.log.Warn("tcp_shm data connection failed", zap.String("remote", c.RemoteAddr().String()), zap.Error(err))
			}
		}()
	}
}

func (s *Server) serve(c net.Conn) error {
	r := bufio.NewReaderSize(c, 1<<20)
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	m := make([]byte, len(magic))
	if _, err := io.ReadFull(r, m); err != nil || string(m) != magic {
		return fmt.Errorf("not a tcp_shm client")
	}
	line, err := r.ReadBytes('\n')
	if err != nil {
		return err
	}
	var h hello
	if err := json.Unmarshal(line, &h); err != nil {
		return fmt.Errorf("bad hello: %w", err)
	}
	reply := func(a ack) error { return json.NewEncoder(c).Encode(a) }
	dst, err := s.target(h.Session)
	if err != nil {
		return reply(ack{Error: err.Error()})
	}
	var a ack
	var hdr [frameHdrSize]byte
	for {
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return fmt.Errorf("read frame: %w", err)
		}
		f := readHeader(hdr[:])
		if f.region == endRegion {
			return reply(a)
		}
		if int(f.region) >= len(dst) || f.length > maxFrame || f.offset+f.length > uint64(len(dst[f.region])) {
			_ = reply(ack{Error: fmt.Sprintf("frame outside the target regions: region %d offset %d length %d", f.region, f.offset, f.length)})
			return fmt.Errorf("frame outside the target regions")
		}
		// Straight into the engine's memory; the checksum is verified
		// before the target resumes (the round fails otherwise).
		b := dst[f.region][f.offset : f.offset+f.length]
		if _, err := io.ReadFull(r, b); err != nil {
			return fmt.Errorf("read frame payload: %w", err)
		}
		if xxhash.Sum64(b) != f.sum {
			a.BadChecksum++
		}
		a.Frames++
		a.Bytes += f.length
	}
}

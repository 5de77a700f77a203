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
	magic        = "VHI-TCPSHM/2\n"
	frameHdrSize = 24 // runs u32, pad u32, payload length u64, xxhash64 u64
	runDescSize  = 20 // region u32, offset u64, length u64
	maxRuns      = 8192
)

// hello opens a connection.
type hello struct {
	Session string `json:"session"` // the migration id: the target checks it expects it
}

// A frame carries up to maxRuns runs and maxFrame payload bytes: a header,
// one descriptor per run, then the runs' bytes back to back, checksummed
// together. Batching matters for the final round, whose token-slot runs
// are many and tiny (one per layer, K/V and head of each written slot
// range). A frame with zero runs ends the connection's share.
type frameHeader struct {
	runs   uint32 // descriptors in the frame
	kind   uint32 // frameRuns or frameSlots
	length uint64
	sum    uint64
}

// Frame kinds. A runs frame carries explicit (region, offset, length)
// descriptors. A slots frame carries (target block, first slot, slots)
// jobs whose bytes come in canonical order — layer, K/V, head — and the
// target expands them with its own layout: the final round's token slots
// are one tiny run per layer, K/V and head, so describing each would cost
// more than the bytes.
const (
	frameRuns  = 0
	frameSlots = 1
	jobSize    = 12 // block u32, first slot u32, slots u32
)

func (h frameHeader) put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], h.runs)
	binary.LittleEndian.PutUint32(b[4:], h.kind)
	binary.LittleEndian.PutUint64(b[8:], h.length)
	binary.LittleEndian.PutUint64(b[16:], h.sum)
}

func readHeader(b []byte) frameHeader {
	return frameHeader{runs: binary.LittleEndian.Uint32(b[0:]), kind: binary.LittleEndian.Uint32(b[4:]),
		length: binary.LittleEndian.Uint64(b[8:]), sum: binary.LittleEndian.Uint64(b[16:])}
}

func putRun(b []byte, region int, offset, length int64) {
	binary.LittleEndian.PutUint32(b[0:], uint32(region))
	binary.LittleEndian.PutUint64(b[4:], uint64(offset))
	binary.LittleEndian.PutUint64(b[12:], uint64(length))
}

func readRun(b []byte) (region uint32, offset, length uint64) {
	return binary.LittleEndian.Uint32(b[0:]), binary.LittleEndian.Uint64(b[4:]), binary.LittleEndian.Uint64(b[12:])
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
	// Split long runs and share them out by bytes, keeping each share in
	// order so the target writes memory sequentially.
	shares := make([][]kvlayout.CopyRun, tn)
	load := make([]int64, tn)
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
	return Stats{Runs: len(runs), Bytes: kvlayout.Bytes(runs), Duration: time.Since(start)}, nil
}

// frameWriter batches descriptors and their bytes into frames.
type frameWriter struct {
	w             *bufio.Writer
	kind          uint32
	descSize      int
	descs         []byte
	payload       []byte
	frames, bytes uint64
	fault         Fault
}

func newFrameWriter(w *bufio.Writer, kind uint32, descSize int, fault Fault) *frameWriter {
	return &frameWriter{w: w, kind: kind, descSize: descSize, fault: fault,
		descs: make([]byte, 0, maxRuns*descSize), payload: make([]byte, 0, maxFrame)}
}

// reserve flushes first when a descriptor with n more payload bytes would
// not fit the current frame.
func (f *frameWriter) reserve(n int) error {
	if len(f.payload)+n > maxFrame || len(f.descs)/f.descSize == maxRuns {
		return f.flush()
	}
	return nil
}

// flush writes the pending frame. The payload is a copy of the source
// bytes, so its checksum matches what is sent even while the engine writes
// (non-final rounds).
func (f *frameWriter) flush() error {
	if len(f.descs) == 0 {
		return nil
	}
	sum := xxhash.Sum64(f.payload)
	if f.fault == CorruptFrame && f.frames == 0 {
		f.payload[0] ^= 0xFF
	}
	var hdr [frameHdrSize]byte
	frameHeader{runs: uint32(len(f.descs) / f.descSize), kind: f.kind, length: uint64(len(f.payload)), sum: sum}.put(hdr[:])
	for _, b := range [][]byte{hdr[:], f.descs, f.payload} {
		if _, err := f.w.Write(b); err != nil {
			return err
		}
	}
	f.frames++
	f.bytes += uint64(len(f.payload))
	f.descs, f.payload = f.descs[:0], f.payload[:0]
	return nil
}

func sendConn(ctx context.Context, addr, session string, src [][]byte, runs []kvlayout.CopyRun, fault Fault) error {
	return withConn(ctx, addr, session, func(w *bufio.Writer) (uint64, uint64, error) {
		fw := newFrameWriter(w, frameRuns, runDescSize, fault)
		for i, r := range runs {
			if fault == CutConn && i == len(runs)/2 {
				return fw.frames, fw.bytes, fmt.Errorf("tcp_shm: injected fault: connection cut after %d of %d runs", i, len(runs))
			}
			if err := fw.reserve(int(r.Length)); err != nil {
				return fw.frames, fw.bytes, err
			}
			var desc [runDescSize]byte
			putRun(desc[:], r.DstRegion, r.DstOffset, r.Length)
			fw.descs = append(fw.descs, desc[:]...)
			fw.payload = append(fw.payload, src[r.SrcRegion][r.SrcOffset:r.SrcOffset+r.Length]...)
		}
		err := fw.flush()
		return fw.frames, fw.bytes, err
	})
}

// Memory is one side's KV as the data plane sees it: mapped regions and
// their layout.
type Memory struct {
	Data          [][]byte
	Specs         []kvlayout.RegionSpec
	Layers, Heads int
	SlotBytes     int64
	// Sink, when set, receives the runs instead of Data (KV the agent
	// cannot map: GPU memory, written through staging). It must copy the
	// bytes it is given; Flush makes everything written so far land and
	// is called before the share is acknowledged. A Sink that is an
	// io.Closer is closed when the connection ends.
	Sink Sink
}

// Sink takes a target's writes (see Memory.Sink).
type Sink interface {
	Write(region int, at uint64, b []byte) error
	Flush() error
}

// Target resolves the memory a session writes into; an error refuses it.
type Target func(session string) (*Memory, error)

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
	mem, err := s.target(h.Session)
	if err != nil {
		return reply(ack{Error: err.Error()})
	}
	dst := mem.Data
	if c, ok := mem.Sink.(io.Closer); ok {
		defer c.Close()
	}
	var places []slotPlace
	if mem.Layers > 0 {
		if places, err = slotPlaces(mem); err != nil {
			return reply(ack{Error: err.Error()})
		}
	}
	var a ack
	var hdr [frameHdrSize]byte
	descs := make([]byte, maxRuns*runDescSize)
	payload := make([]byte, maxFrame)
	for {
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return fmt.Errorf("read frame: %w", err)
		}
		f := readHeader(hdr[:])
		if f.runs == 0 {
			if mem.Sink != nil {
				if err := mem.Sink.Flush(); err != nil {
					return reply(ack{Error: err.Error()})
				}
			}
			return reply(a)
		}
		if f.runs > maxRuns || f.length > maxFrame {
			_ = reply(ack{Error: fmt.Sprintf("frame of %d runs / %d bytes is over the limits", f.runs, f.length)})
			return fmt.Errorf("oversized frame")
		}
		descSize := runDescSize
		if f.kind == frameSlots {
			descSize = jobSize
		}
		d := descs[:int(f.runs)*descSize]
		p := payload[:f.length]
		if _, err := io.ReadFull(r, d); err != nil {
			return fmt.Errorf("read frame runs: %w", err)
		}
		if _, err := io.ReadFull(r, p); err != nil {
			return fmt.Errorf("read frame payload: %w", err)
		}
		// Verify before touching the engine's memory: a bad frame writes
		// nothing, and the round fails, so the target never resumes on it.
		if xxhash.Sum64(p) != f.sum {
			a.BadChecksum++
			a.Frames++
			a.Bytes += f.length
			continue
		}
		if f.kind == frameSlots {
			if mem.Sink != nil {
				_ = reply(ack{Error: "this target takes runs, not slot jobs"})
				return fmt.Errorf("slot frame for a sink target")
			}
			if err := scatterSlots(dst, places, mem.SlotBytes, d, p); err != nil {
				_ = reply(ack{Error: err.Error()})
				return err
			}
			a.Frames++
			a.Bytes += f.length
			continue
		}
		var off uint64
		for k := 0; k < int(f.runs); k++ {
			region, at, n := readRun(d[k*runDescSize:])
			if mem.Sink != nil {
				if off+n > f.length {
					_ = reply(ack{Error: "run outside the frame"})
					return fmt.Errorf("run outside the frame")
				}
				if err := mem.Sink.Write(int(region), at, p[off:off+n]); err != nil {
					_ = reply(ack{Error: err.Error()})
					return err
				}
				off += n
				continue
			}
			if int(region) >= len(dst) || at+n > uint64(len(dst[region])) || off+n > f.length {
				_ = reply(ack{Error: fmt.Sprintf("run outside the target regions: region %d offset %d length %d", region, at, n)})
				return fmt.Errorf("run outside the target regions")
			}
			copy(dst[region][at:at+n], p[off:off+n])
			off += n
		}
		a.Frames++
		a.Bytes += f.length
	}
}

// slotPlace is where one (layer, K/V, head) lives: region, and the offset
// of block 0 slot 0 with the block and slot strides.
type slotPlace struct {
	region            int
	base, block, slot int64
}

// slotPlaces lists the places of every (layer, K/V, head) in canonical
// order for a memory's layout.
func slotPlaces(m *Memory) ([]slotPlace, error) {
	out := make([]slotPlace, 0, m.Layers*2*m.Heads)
	for l := 0; l < m.Layers; l++ {
		for kv := 0; kv < 2; kv++ {
			for h := 0; h < m.Heads; h++ {
				found := false
				for i, r := range m.Specs {
					if l >= r.FirstLayer && l < r.FirstLayer+r.NumLayers && h >= r.FirstHead && h < r.FirstHead+r.NumHeads {
						st := r.Strides
						out = append(out, slotPlace{region: i, base: int64(l-r.FirstLayer)*st.Layer + int64(kv)*st.KV + int64(h-r.FirstHead)*st.Head, block: st.Block, slot: st.Slot})
						found = true
						break
					}
				}
				if !found {
					return nil, fmt.Errorf("layer %d head %d is in no region", l, h)
				}
			}
		}
	}
	return out, nil
}

// scatterSlots writes a slots frame's payload into memory.
func scatterSlots(dst [][]byte, places []slotPlace, slotBytes int64, jobs, payload []byte) error {
	var off int64
	for k := 0; k+jobSize <= len(jobs); k += jobSize {
		block := int64(binary.LittleEndian.Uint32(jobs[k:]))
		first := int64(binary.LittleEndian.Uint32(jobs[k+4:]))
		n := int64(binary.LittleEndian.Uint32(jobs[k+8:])) * slotBytes
		for _, p := range places {
			at := p.base + block*p.block + first*p.slot
			if p.slot == slotBytes {
				if at < 0 || at+n > int64(len(dst[p.region])) || off+n > int64(len(payload)) {
					return fmt.Errorf("slot job outside the target regions (block %d)", block)
				}
				copy(dst[p.region][at:at+n], payload[off:off+n])
				off += n
				continue
			}
			for k := int64(0); k < n/slotBytes; k++ { // slots not packed: one at a time
				a := at + k*p.slot
				if a < 0 || a+slotBytes > int64(len(dst[p.region])) || off+slotBytes > int64(len(payload)) {
					return fmt.Errorf("slot job outside the target regions (block %d)", block)
				}
				copy(dst[p.region][a:a+slotBytes], payload[off:off+slotBytes])
				off += slotBytes
			}
		}
	}
	if off != int64(len(payload)) {
		return fmt.Errorf("slot frame payload of %d bytes, jobs describe %d", len(payload), off)
	}
	return nil
}

// SendSlots copies token slots — slots [FirstSlot, FirstSlot+NumSlots) of
// each source block into the same slots of its target block — gathering
// them in canonical order so the target scatters them with its own layout.
func SendSlots(ctx context.Context, addr, session string, tn int, src *Memory, jobs []kvlayout.BlockCopy, fault Fault) (Stats, error) {
	start := time.Now()
	places, err := slotPlaces(src)
	if err != nil {
		return Stats{}, err
	}
	if tn < 1 {
		tn = 1
	}
	shares := make([][]kvlayout.BlockCopy, tn)
	for i, j := range jobs {
		shares[i%tn] = append(shares[i%tn], j)
	}
	var wg sync.WaitGroup
	errs := make([]error, tn)
	var total int64
	for _, j := range jobs {
		total += int64(j.NumSlots) * src.SlotBytes * int64(len(places))
	}
	for i := range shares {
		if len(shares[i]) == 0 {
			continue
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			f := NoFault
			if i == 0 {
				f = fault
			}
			errs[i] = sendSlotsConn(ctx, addr, session, src, places, shares[i], f)
		}(i)
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return Stats{}, err
	}
	return Stats{Runs: len(jobs) * len(places), Bytes: total, Duration: time.Since(start)}, nil
}

func sendSlotsConn(ctx context.Context, addr, session string, src *Memory, places []slotPlace, jobs []kvlayout.BlockCopy, fault Fault) error {
	return withConn(ctx, addr, session, func(w *bufio.Writer) (uint64, uint64, error) {
		fw := newFrameWriter(w, frameSlots, jobSize, fault)
		for i, j := range jobs {
			if fault == CutConn && i == len(jobs)/2 {
				return fw.frames, fw.bytes, fmt.Errorf("tcp_shm: injected fault: connection cut after %d of %d slot jobs", i, len(jobs))
			}
			n := int64(j.NumSlots) * src.SlotBytes
			if err := fw.reserve(int(n) * len(places)); err != nil {
				return fw.frames, fw.bytes, err
			}
			var d [jobSize]byte
			binary.LittleEndian.PutUint32(d[0:], uint32(j.Dst))
			binary.LittleEndian.PutUint32(d[4:], uint32(j.FirstSlot))
			binary.LittleEndian.PutUint32(d[8:], uint32(j.NumSlots))
			fw.descs = append(fw.descs, d[:]...)
			for _, p := range places {
				at := p.base + int64(j.Src)*p.block + int64(j.FirstSlot)*p.slot
				if p.slot == src.SlotBytes {
					fw.payload = append(fw.payload, src.Data[p.region][at:at+n]...)
					continue
				}
				for k := int64(0); k < int64(j.NumSlots); k++ {
					a := at + k*p.slot
					fw.payload = append(fw.payload, src.Data[p.region][a:a+src.SlotBytes]...)
				}
			}
		}
		err := fw.flush()
		return fw.frames, fw.bytes, err
	})
}

// withConn opens a data connection, lets send write its frames, ends the
// share and checks the target's acknowledgement.
func withConn(ctx context.Context, addr, session string, send func(w *bufio.Writer) (frames, bytes uint64, err error)) error {
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
	frames, bytes, err := send(w)
	if err != nil {
		_ = w.Flush()
		return fmt.Errorf("tcp_shm: send: %w", err)
	}
	var hdr [frameHdrSize]byte
	frameHeader{}.put(hdr[:])
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
	case a.Frames != frames || a.Bytes != bytes:
		return fmt.Errorf("tcp_shm: target acknowledged %d frames / %d bytes, sent %d / %d", a.Frames, a.Bytes, frames, bytes)
	}
	return nil
}

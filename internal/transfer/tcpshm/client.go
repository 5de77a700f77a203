package tcpshm

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// Dest is where a source sends one migration's KV: the target's data
// address, the migration (session) id and its secret, and the TLS client
// configuration when the data plane runs over TLS.
type Dest struct {
	Addr    string
	Session string
	Secret  []byte
	TLS     *tls.Config
	// Carrier, when set, carries the frames' payloads (the rdma data
	// plane); the connection keeps the handshake, descriptors, checksums
	// and acknowledgements.
	Carrier Carrier
	// Pace, when set, paces the frames (transfer.Round.Pace): each takes
	// its bytes from it and goes out at once, in frames of at most
	// pacedFrame.
	Pace transfer.Pacer
}

// pacedFrame bounds a paced round's frames: the pacer's grain.
const pacedFrame = 64 << 10

// frameLimit is the largest payload of dst's frames.
func (dst Dest) frameLimit() int64 {
	if dst.Pace != nil {
		return pacedFrame
	}
	return maxFrame
}

// Send copies runs from src (mapped source regions) to the target over tn
// connections.
func Send(ctx context.Context, dst Dest, tn int, src [][]byte, runs []kvlayout.CopyRun, fault transfer.Fault) (transfer.Stats, error) {
	start := time.Now()
	if tn < 1 {
		tn = 1
	}
	// Split long runs and share them out by bytes, keeping each share in
	// order so the target writes memory sequentially.
	shares := make([][]kvlayout.CopyRun, tn)
	load := make([]int64, tn)
	for _, r := range runs {
		if r.SrcRegion < 0 || r.SrcRegion >= len(src) || r.SrcOffset < 0 || r.Length < 0 || r.SrcOffset > int64(len(src[r.SrcRegion]))-r.Length {
			return transfer.Stats{}, fmt.Errorf("tcp_shm: run %+v outside the source regions", r)
		}
		limit := dst.frameLimit()
		for off := int64(0); off < r.Length; off += limit {
			n := min(limit, r.Length-off)
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
	// Share 0 goes even when empty: a round with nothing to move still
	// checks that the target takes the migration.
	err := eachShare(tn, fault, func(i int) bool { return i == 0 || len(shares[i]) > 0 }, func(i int, f transfer.Fault) error {
		return sendConn(ctx, dst, src, shares[i], f)
	})
	if err != nil {
		return transfer.Stats{}, err
	}
	return transfer.Stats{Runs: len(runs), Bytes: kvlayout.Bytes(runs), Duration: time.Since(start)}, nil
}

// eachShare runs send for every share that goes, each on its own
// goroutine (its own connection); the fault is injected into share 0.
func eachShare(n int, fault transfer.Fault, goes func(i int) bool, send func(i int, f transfer.Fault) error) error {
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := 0; i < n; i++ {
		if !goes(i) {
			continue
		}
		f := transfer.NoFault
		if i == 0 {
			f = fault
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = send(i, f)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// frameWriter batches descriptors and their bytes into frames.
type frameWriter struct {
	w             *bufio.Writer
	kind          uint32
	descSize      int
	descs         []byte
	payload       []byte
	limit         int // payload bytes per frame
	frames, bytes uint64
	fault         transfer.Fault
	carried       *carriage // nil: payloads go in the stream
	// pace, when set, gives each frame its bytes before it goes (ctx
	// bounds the wait), and the frame is written out at once.
	pace transfer.Pacer
	ctx  context.Context
}

// paced makes f take each frame's bytes from dst's pacer (none: as it is).
func (f *frameWriter) paced(ctx context.Context, dst Dest) *frameWriter {
	if dst.Pace != nil {
		f.pace, f.ctx = dst.Pace, ctx
		f.limit = min(f.limit, pacedFrame)
	}
	return f
}

func newFrameWriter(w *bufio.Writer, kind uint32, descSize int, fault transfer.Fault, c *carriage) *frameWriter {
	f := &frameWriter{w: w, kind: kind, descSize: descSize, fault: fault, carried: c, limit: maxFrame,
		descs: make([]byte, 0, maxRuns*descSize)}
	if c != nil {
		// Frames are assembled where the carrier sends from, and no
		// larger than the target's staging slots.
		f.limit = min(maxFrame, c.conn.SlotSize())
		f.payload = c.conn.Buffer(0)[:0:f.limit]
	} else {
		f.payload = make([]byte, 0, maxFrame)
	}
	return f
}

// reserve flushes first when a descriptor with n more payload bytes would
// not fit the current frame.
func (f *frameWriter) reserve(n int) error {
	if n > f.limit {
		return fmt.Errorf("tcp_shm: a run of %d bytes is over the frame limit of %d", n, f.limit)
	}
	if len(f.payload)+n > f.limit || len(f.descs)/f.descSize == maxRuns {
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
	if f.pace != nil {
		if err := f.pace.Take(f.ctx, int64(len(f.payload))); err != nil {
			return err
		}
	}
	if f.fault == transfer.CorruptSilently && f.frames == 0 {
		f.payload[0] ^= 0xFF
	}
	sum := xxhash.Sum64(f.payload)
	if f.fault == transfer.CorruptFrame && f.frames == 0 {
		f.payload[0] ^= 0xFF
	}
	var hdr [frameHdrSize]byte
	if c := f.carried; c != nil {
		// The carriage's sender puts the payload into its staging slot
		// and then writes the header and descriptors, while the next frame
		// is assembled in the next slot's buffer.
		slot := f.frames % uint64(c.conn.Slots())
		frameHeader{runs: uint32(len(f.descs) / f.descSize), kind: f.kind | kindCarried | uint32(slot)<<slotShift,
			length: uint64(len(f.payload)), sum: sum}.put(hdr[:])
		if err := c.enqueue(carriedFrame{slot: int(slot), payload: f.payload, hdr: hdr, descs: append([]byte(nil), f.descs...)}); err != nil {
			return err
		}
		f.frames++
		f.bytes += uint64(len(f.payload))
		next, err := c.buffer(f.frames)
		if err != nil {
			return err
		}
		f.descs, f.payload = f.descs[:0], next[:0:f.limit]
		return nil
	}
	frameHeader{runs: uint32(len(f.descs) / f.descSize), kind: f.kind, length: uint64(len(f.payload)), sum: sum}.put(hdr[:])
	for _, b := range [][]byte{hdr[:], f.descs, f.payload} {
		if _, err := f.w.Write(b); err != nil {
			return err
		}
	}
	if f.pace != nil {
		// A paced frame goes now: the pacer's accounting is of bytes sent.
		if err := f.w.Flush(); err != nil {
			return err
		}
	}
	f.frames++
	f.bytes += uint64(len(f.payload))
	f.descs, f.payload = f.descs[:0], f.payload[:0]
	return nil
}

// emptyRoundFault is an injected fault's failure in a round with nothing
// to move: a test's fault must not depend on whether the engine wrote
// since the last round. A cut fails as it would halfway; a corrupt frame,
// which the target would refuse, fails here (an empty round has no frame
// to damage).
func emptyRoundFault(fault transfer.Fault) error {
	switch fault {
	case transfer.CutConn:
		return errors.New("tcp_shm: injected fault: connection cut before anything was sent (an empty round)")
	case transfer.CorruptFrame:
		return errors.New("tcp_shm: injected fault: a corrupt frame in a round with nothing to move")
	}
	return nil
}

func sendConn(ctx context.Context, dst Dest, src [][]byte, runs []kvlayout.CopyRun, fault transfer.Fault) error {
	return withConn(ctx, dst, func(w *bufio.Writer, c *carriage) (uint64, uint64, error) {
		fw := newFrameWriter(w, frameRuns, runDescSize, fault, c).paced(ctx, dst)
		if len(runs) == 0 {
			if err := emptyRoundFault(fault); err != nil {
				return 0, 0, err
			}
		}
		for i, r := range runs {
			if fault == transfer.CutConn && i == len(runs)/2 {
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

// SendSlots copies token slots — slots [FirstSlot, FirstSlot+NumSlots) of
// each source block into the same slots of its target block — gathering
// them in canonical order so the target scatters them with its own layout.
func SendSlots(ctx context.Context, dst Dest, tn int, src *Memory, jobs []kvlayout.BlockCopy, fault transfer.Fault) (transfer.Stats, error) {
	start := time.Now()
	places, err := slotPlaces(src)
	if err != nil {
		return transfer.Stats{}, err
	}
	if tn < 1 {
		tn = 1
	}
	shares := make([][]kvlayout.BlockCopy, tn)
	for i, j := range jobs {
		shares[i%tn] = append(shares[i%tn], j)
	}
	var total int64
	for _, j := range jobs {
		total += int64(j.NumSlots) * src.SlotBytes * int64(len(places))
	}
	// Share 0 goes even when empty, as in Send: a final round with no new
	// token still checks that the target takes the migration (and a fault
	// injected into it still fires).
	err = eachShare(tn, fault, func(i int) bool { return i == 0 || len(shares[i]) > 0 }, func(i int, f transfer.Fault) error {
		return sendSlotsConn(ctx, dst, src, places, shares[i], f)
	})
	if err != nil {
		return transfer.Stats{}, err
	}
	return transfer.Stats{Runs: len(jobs) * len(places), Bytes: total, Duration: time.Since(start)}, nil
}

func sendSlotsConn(ctx context.Context, dst Dest, src *Memory, places []slotPlace, jobs []kvlayout.BlockCopy, fault transfer.Fault) error {
	return withConn(ctx, dst, func(w *bufio.Writer, c *carriage) (uint64, uint64, error) {
		fw := newFrameWriter(w, frameSlots, jobSize, fault, c).paced(ctx, dst)
		if len(jobs) == 0 {
			if err := emptyRoundFault(fault); err != nil {
				return 0, 0, err
			}
		}
		for i, j := range jobs {
			if fault == transfer.CutConn && i == len(jobs)/2 {
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

// withConn opens a data connection, authenticates it, lets send write its
// frames, ends the share and checks the target's acknowledgement.
func withConn(ctx context.Context, dst Dest, send func(w *bufio.Writer, c *carriage) (frames, bytes uint64, err error)) error {
	d := net.Dialer{Timeout: 5 * time.Second}
	raw, err := d.DialContext(ctx, "tcp", dst.Addr)
	if err != nil {
		return fmt.Errorf("tcp_shm: dial %s: %w", dst.Addr, err)
	}
	defer raw.Close()
	if tc, ok := raw.(*net.TCPConn); ok && dst.Pace != nil {
		// Paced, a burst is the pacer's bytes, not as many more as the
		// kernel's socket buffer takes (megabytes on loopback): the
		// sender's writes wait for the target once it lags a few frames.
		_ = tc.SetWriteBuffer(4 * pacedFrame)
	}
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	conn := raw
	_ = raw.SetDeadline(time.Now().Add(DefaultHandshakeTimeout))
	if dst.TLS != nil {
		cfg := dst.TLS.Clone()
		if cfg.ServerName == "" {
			cfg.ServerName, _, _ = net.SplitHostPort(dst.Addr)
		}
		tc := tls.Client(raw, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			return fmt.Errorf("tcp_shm: TLS handshake with %s: %w", dst.Addr, err)
		}
		conn = tc
	}
	mode := ""
	if dst.Carrier != nil {
		mode = dst.Carrier.Mode()
	}
	br, err := clientHandshake(conn, dst.Session, dst.Secret, mode)
	if err != nil {
		return err
	}
	// Everything the target says after the handshake is JSON lines: the
	// carrier's greeting, credits, the acknowledgement.
	dec := json.NewDecoder(br)
	var carried *carriage
	if dst.Carrier != nil {
		var g greetingMsg
		if err := dec.Decode(&g); err != nil {
			return fmt.Errorf("tcp_shm: no %s greeting from the target: %w", mode, err)
		}
		if g.Error != "" {
			return fmt.Errorf("tcp_shm: target: %s", g.Error)
		}
		cc, err := dst.Carrier.Open(g.Greeting)
		if err != nil {
			return err
		}
		defer cc.Close()
		carried = &carriage{conn: cc, credits: newCredits()}
		go carried.credits.read(dec)
	}
	_ = raw.SetDeadline(time.Time{})
	w := bufio.NewWriterSize(conn, 1<<20)
	if carried != nil {
		carried.start(w, func() { raw.Close() })
	}
	// A target that refuses a frame says why and hangs up; the writes
	// that follow fail, and its reason is the error worth reporting.
	final := func() (ack, error) {
		if carried != nil {
			return carried.credits.result()
		}
		var a ack
		err := dec.Decode(&a)
		return a, err
	}
	refused := func(err error) error {
		_ = raw.SetReadDeadline(time.Now().Add(time.Second))
		if a, aerr := final(); aerr == nil && a.Error != "" {
			return fmt.Errorf("tcp_shm: target: %s", a.Error)
		}
		return fmt.Errorf("tcp_shm: send: %w", err)
	}
	frames, bytes, err := send(w, carried)
	if carried != nil {
		// Everything queued is put and announced (or the sender failed)
		// before the end frame goes.
		if serr := carried.finish(); err == nil {
			err = serr
		}
	}
	if err != nil {
		if w.Flush() != nil {
			return refused(err)
		}
		return fmt.Errorf("tcp_shm: send: %w", err)
	}
	var hdr [frameHdrSize]byte
	frameHeader{}.put(hdr[:])
	if _, err := w.Write(hdr[:]); err != nil {
		return refused(err)
	}
	if err := w.Flush(); err != nil {
		return refused(err)
	}
	_ = raw.SetReadDeadline(time.Now().Add(DefaultIdleTimeout))
	a, err := final()
	if err != nil {
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

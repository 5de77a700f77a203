package cudaipc

import (
	"errors"
	"fmt"
	"sync"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// GPU KV over tcp_shm (another node, or no IPC): the source gathers its
// runs' bytes from GPU memory into pinned host memory and sends them as
// ordinary tcp_shm runs; the target stages what arrives in pinned memory
// and scatters it into its GPU regions.

// Gather copies the source bytes of runs, in order, from GPU regions src
// into one host buffer, and returns it (valid until the next Gather) with
// the runs rewritten to read from it (region 0).
func (c *Copier) Gather(src Regions, runs []kvlayout.CopyRun) ([]byte, []kvlayout.CopyRun, error) {
	var total int64
	for _, r := range runs {
		if r.SrcRegion >= len(src) {
			return nil, nil, fmt.Errorf("cuda_ipc: run names source region %d of %d", r.SrcRegion, len(src))
		}
		total += r.Length
	}
	if err := c.reserve(uint64(total)); err != nil {
		return nil, nil, err
	}
	out := make([]kvlayout.CopyRun, len(runs))
	packed := make([]kvlayout.CopyRun, len(runs)) // device: source region → staging (region 0)
	var at int64
	for i, r := range runs {
		out[i] = kvlayout.CopyRun{SrcRegion: 0, SrcOffset: at, DstRegion: r.DstRegion, DstOffset: r.DstOffset, Length: r.Length}
		packed[i] = kvlayout.CopyRun{SrcRegion: r.SrcRegion, SrcOffset: r.SrcOffset, DstRegion: 0, DstOffset: at, Length: r.Length}
		at += r.Length
	}
	if err := c.Run(src, Regions{c.devStage}, packed); err != nil {
		return nil, nil, err
	}
	host := c.hostStage[:total]
	if err := c.Driver.DtoHAsync(c.Device, c.Stream, host, c.devStage); err != nil {
		return nil, nil, err
	}
	return host, out, c.Driver.Sync(c.Device, c.Stream)
}

// Reserve sizes the pinned host and device staging buffers to at least n
// bytes now (allocating pinned memory stalls the device: a copier that
// stages inside a pause reserves beforehand).
func (c *Copier) Reserve(n uint64) error { return c.reserve(n) }

// reserve sizes the pinned host and device staging buffers to n bytes.
func (c *Copier) reserve(n uint64) error {
	if c.stageCap >= n {
		return nil
	}
	c.releaseStaging()
	n = max(n, 16<<20)
	h, err := c.Driver.HostAlloc(c.Device, n)
	if err != nil {
		return err
	}
	d, err := c.Driver.Alloc(c.Device, n)
	if err != nil {
		_ = c.Driver.HostFree(c.Device, h)
		return err
	}
	c.hostStage, c.devStage, c.stageCap = h, d, n
	return nil
}

func (c *Copier) releaseStaging() {
	if c.stageCap == 0 {
		return
	}
	_ = c.Driver.HostFree(c.Device, c.hostStage)
	_ = c.Driver.Free(c.Device, c.devStage)
	c.hostStage, c.devStage, c.stageCap = nil, 0, 0
}

// Close frees the copier's staging buffers.
func (c *Copier) Close() { c.releaseStaging() }

// Sink is a tcp_shm target writing into GPU regions: runs accumulate in
// pinned memory and land with one upload and one scatter launch per
// Flush (or when the staging fills up).
type Sink struct {
	c       *Copier
	dst     Regions
	sizes   []uint64
	pending []kvlayout.CopyRun // staging (region 0) → dst
	used    uint64
	mu      sync.Mutex
}

// sinkStage is the staging a Sink flushes at.
const sinkStage = 64 << 20

// NewSink writes into dst (region sizes for bounds checks) through c,
// which it owns: Close frees it.
func NewSink(c *Copier, dst Regions, sizes []uint64) (*Sink, error) {
	if err := c.reserve(sinkStage); err != nil {
		return nil, err
	}
	return &Sink{c: c, dst: dst, sizes: sizes}, nil
}

func (k *Sink) Write(region int, at uint64, b []byte) error {
	k.mu.Lock()
	defer k.mu.Unlock()
	n := uint64(len(b))
	if region < 0 || region >= len(k.dst) || at > k.sizes[region] || n > k.sizes[region]-at {
		return fmt.Errorf("run outside the target regions: region %d offset %d length %d", region, at, n)
	}
	if n > k.c.stageCap {
		return errors.New("cuda_ipc: a run larger than the staging buffer")
	}
	if k.used+n > k.c.stageCap {
		if err := k.flushLocked(); err != nil {
			return err
		}
	}
	copy(k.c.hostStage[k.used:], b)
	k.pending = append(k.pending, kvlayout.CopyRun{SrcRegion: 0, SrcOffset: int64(k.used), DstRegion: region, DstOffset: int64(at), Length: int64(n)})
	k.used += n
	return nil
}

func (k *Sink) Flush() error {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.flushLocked()
}

func (k *Sink) flushLocked() error {
	if len(k.pending) == 0 {
		return nil
	}
	c := k.c
	if err := c.Driver.HtoDAsync(c.Device, c.Stream, c.devStage, c.hostStage[:k.used]); err != nil {
		return err
	}
	err := c.Run(Regions{c.devStage}, k.dst, k.pending) // ordered after the upload on the stream; waits
	k.pending, k.used = k.pending[:0], 0
	return err
}

// Close frees the sink's staging.
func (k *Sink) Close() error {
	k.c.Close()
	return nil
}

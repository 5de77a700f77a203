// Package cudaipc is the same-node GPU data plane: both engines' KV
// regions are mapped into the copying process through CUDA IPC handles and
// the copy plan runs GPU to GPU (NVLink or PCIe peer-to-peer), never
// through host memory.
//
// Copies are never issued one driver call per small block: adjacent runs
// are merged by the planner, and the rest go to the driver in batches
// (cuMemcpyBatchAsync where the driver has it, one cgo call per batch
// otherwise).
package cudaipc

import (
	"fmt"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// DefaultMaxBatch bounds one batched copy-engine call's copies (the
// driver's batch descriptors live in host memory it walks; 16k keeps a
// call short). The copy kernel takes a whole Run in one launch.
const DefaultMaxBatch = 16384

// Regions are device base addresses of a side's KV regions, in the
// layout's region order.
type Regions []cuda.DevicePtr

// Copy methods.
const (
	// MethodAuto uses the copy kernel (measured faster than the copy
	// engines for scattered blocks of 64 KiB and 2.36 MB alike) and falls
	// back to batched copy-engine copies for unaligned runs.
	MethodAuto = ""
	// MethodKernel: one copy kernel launch per Run (a round).
	MethodKernel = "kernel"
	// MethodBatch: cuMemcpyBatchAsync (copy engines).
	MethodBatch = "batch"
)

// kernelPiece bounds the bytes one CTA of the copy kernel moves for one
// descriptor: longer runs are cut, so a few large runs still spread over
// every SM (one 23 GB run on one CTA ran at 46 GB/s; see benchmarks.md).
const kernelPiece = 512 << 10

// Copier runs copy plans on one device's stream.
type Copier struct {
	Driver   cuda.Driver
	Device   int // the device whose context issues the copies
	Stream   cuda.Stream
	MaxBatch int
	Method   string

	// staging for tcp_shm moves (Gather, Sink)
	hostStage []byte
	devStage  cuda.DevicePtr
	stageCap  uint64
}

// KernelCopies are the copies one kernel launch of Run makes for runs:
// each run's addresses in the regions, long runs cut in kernelPiece
// pieces (benchmarks time the launch apart from the rest of Run).
func KernelCopies(src, dst Regions, runs []kvlayout.CopyRun) ([]cuda.Copy, error) {
	out := make([]cuda.Copy, 0, len(runs))
	for _, r := range runs {
		if r.SrcRegion >= len(src) || r.DstRegion >= len(dst) {
			return nil, fmt.Errorf("cuda_ipc: run names region %d→%d of %d→%d", r.SrcRegion, r.DstRegion, len(src), len(dst))
		}
		for off := int64(0); off < r.Length; off += kernelPiece {
			n := min(kernelPiece, r.Length-off)
			out = append(out, cuda.Copy{Src: src[r.SrcRegion] + cuda.DevicePtr(r.SrcOffset+off), Dst: dst[r.DstRegion] + cuda.DevicePtr(r.DstOffset+off), Len: uint64(n)})
		}
	}
	return out, nil
}

// Run copies runs from src to dst regions and waits until they landed.
func (c *Copier) Run(src, dst Regions, runs []kvlayout.CopyRun) error {
	useKernel := c.Method == MethodKernel || c.Method == MethodAuto
	pieces, aligned := 0, true
	for _, r := range runs {
		if r.SrcRegion >= len(src) || r.DstRegion >= len(dst) {
			return fmt.Errorf("cuda_ipc: run names region %d→%d of %d→%d", r.SrcRegion, r.DstRegion, len(src), len(dst))
		}
		switch {
		case r.Length <= 0:
			continue
		case useKernel && r.Length > kernelPiece:
			pieces += int((r.Length + kernelPiece - 1) / kernelPiece)
		default:
			pieces++
		}
		aligned = aligned && (uint64(src[r.SrcRegion])|uint64(dst[r.DstRegion])|uint64(r.SrcOffset)|uint64(r.DstOffset)|uint64(r.Length))%16 == 0
	}
	if useKernel && aligned {
		// One launch a chunk, the descriptors written where the launch
		// reads them while the GPU copies the chunks before: a round 0 of
		// 8B-shaped blocks is ~400,000 pieces, whose list built in Go and
		// copied again cost as long as the kernel (benchmarks.md).
		if err := c.Driver.KernelCopyFill(c.Device, c.Stream, pieces, kernelPieces(src, dst, runs)); err != nil {
			return err
		}
		return c.Driver.Sync(c.Device, c.Stream)
	}
	// Unaligned runs (or the copy engines asked for): batched copy-engine
	// calls.
	max := c.MaxBatch
	if max <= 0 {
		max = DefaultMaxBatch
	}
	batch := make([]cuda.Copy, 0, min(pieces, max))
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := c.Driver.CopyBatch(c.Device, c.Stream, batch)
		batch = batch[:0]
		return err
	}
	for _, r := range runs {
		if r.Length <= 0 {
			continue
		}
		batch = append(batch, cuda.Copy{Src: src[r.SrcRegion] + cuda.DevicePtr(r.SrcOffset), Dst: dst[r.DstRegion] + cuda.DevicePtr(r.DstOffset), Len: uint64(r.Length)})
		if len(batch) == max {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if err := flush(); err != nil {
		return err
	}
	return c.Driver.Sync(c.Device, c.Stream)
}

// kernelPieces is the fill of KernelCopyFill for runs (regions checked):
// each run's copies in turn, runs longer than kernelPiece cut in pieces,
// chunk after chunk from where the last one stopped.
func kernelPieces(src, dst Regions, runs []kvlayout.CopyRun) func(chunk []cuda.Copy) {
	ri, off := 0, int64(0) // the next piece: run ri from off
	return func(chunk []cuda.Copy) {
		for i := range chunk {
			for runs[ri].Length <= off {
				ri, off = ri+1, 0
			}
			r := &runs[ri]
			n := min(kernelPiece, r.Length-off)
			chunk[i] = cuda.Copy{Src: src[r.SrcRegion] + cuda.DevicePtr(r.SrcOffset+off), Dst: dst[r.DstRegion] + cuda.DevicePtr(r.DstOffset+off), Len: uint64(n)}
			off += n
		}
	}
}

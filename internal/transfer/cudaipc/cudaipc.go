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
	"errors"
	"fmt"
	"math"

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
	max := c.MaxBatch
	switch {
	case useKernel:
		// One launch for the round: the descriptors' upload and the
		// launch are paid once, not once per 16k runs with the GPU idle
		// while the next batch is built.
		max = math.MaxInt
	case max <= 0:
		max = DefaultMaxBatch
	}
	// Sized once: a round 0 of 8B-shaped blocks is ~150,000 runs, and
	// growing the batch as it filled cost most of the host's part of the
	// copy (memmoves and the collections they caused).
	pieces := 0
	for _, r := range runs {
		switch {
		case r.Length <= 0:
		case useKernel && r.Length > kernelPiece:
			pieces += int((r.Length + kernelPiece - 1) / kernelPiece)
		default:
			pieces++
		}
	}
	batch := make([]cuda.Copy, 0, min(pieces, max))
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		var err error
		if useKernel {
			if err = c.Driver.KernelCopy(c.Device, c.Stream, batch); errors.Is(err, cuda.ErrUnaligned) {
				err = c.Driver.CopyBatch(c.Device, c.Stream, batch)
			}
		} else {
			err = c.Driver.CopyBatch(c.Device, c.Stream, batch)
		}
		batch = batch[:0]
		return err
	}
	for _, r := range runs {
		if r.SrcRegion >= len(src) || r.DstRegion >= len(dst) {
			return fmt.Errorf("cuda_ipc: run names region %d→%d of %d→%d", r.SrcRegion, r.DstRegion, len(src), len(dst))
		}
		if r.Length <= 0 {
			continue
		}
		sb, db := src[r.SrcRegion]+cuda.DevicePtr(r.SrcOffset), dst[r.DstRegion]+cuda.DevicePtr(r.DstOffset)
		if !useKernel || r.Length <= kernelPiece {
			// Most runs: one copy each.
			batch = append(batch, cuda.Copy{Src: sb, Dst: db, Len: uint64(r.Length)})
			if len(batch) == max {
				if err := flush(); err != nil {
					return err
				}
			}
			continue
		}
		piece := int64(kernelPiece)
		for off := int64(0); off < r.Length; off += piece {
			n := min(piece, r.Length-off)
			batch = append(batch, cuda.Copy{Src: sb + cuda.DevicePtr(off), Dst: db + cuda.DevicePtr(off), Len: uint64(n)})
			if len(batch) == max {
				if err := flush(); err != nil {
					return err
				}
			}
		}
	}
	if err := flush(); err != nil {
		return err
	}
	return c.Driver.Sync(c.Device, c.Stream)
}

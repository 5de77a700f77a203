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

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// DefaultMaxBatch bounds one driver call's copies (the driver's batch
// descriptors live in host memory it walks; 16k keeps a call short).
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
	// MethodKernel: one vhi_copy kernel launch per batch of runs.
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

// Run copies runs from src to dst regions and waits until they landed.
func (c *Copier) Run(src, dst Regions, runs []kvlayout.CopyRun) error {
	max := c.MaxBatch
	if max <= 0 {
		max = DefaultMaxBatch
	}
	useKernel := c.Method == MethodKernel || c.Method == MethodAuto
	batch := make([]cuda.Copy, 0, min(len(runs), max))
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
		piece := r.Length
		if useKernel && piece > kernelPiece {
			piece = kernelPiece
		}
		for off := int64(0); off < r.Length; off += piece {
			n := min(piece, r.Length-off)
			batch = append(batch, cuda.Copy{Src: src[r.SrcRegion] + cuda.DevicePtr(r.SrcOffset+off), Dst: dst[r.DstRegion] + cuda.DevicePtr(r.DstOffset+off), Len: uint64(n)})
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

// Package cuda is a small binding to the CUDA driver API, loaded at run time
// with dlopen("libcuda.so.1"): the vhi binary builds and runs on machines
// without CUDA, where Load reports ErrUnavailable. The library is loaded
// once and reference counted (go-nvml's pattern); every entry point checks
// that it is loaded. Driver is the interface the rest of vllm-hi uses, so
// copy planning and the data plane are tested without a GPU.
package cuda

import (
	"errors"
	"fmt"
)

// ErrUnavailable is returned where no CUDA driver can be loaded.
var ErrUnavailable = errors.New("unavailable: libcuda not found")

// ErrUnaligned is returned by KernelCopy for copies not on 16-byte
// boundaries (the caller falls back to CopyBatch).
var ErrUnaligned = errors.New("cuda: kernel copy needs 16-byte aligned addresses and lengths")

// ErrNotLoaded is returned by calls made after the last Close.
var ErrNotLoaded = errors.New("cuda: library not loaded")

// Error is a CUresult other than CUDA_SUCCESS, with the driver's name for
// it (CUDA_ERROR_OUT_OF_MEMORY, …).
type Error struct {
	Code int
	Name string
	Op   string
}

func (e *Error) Error() string { return fmt.Sprintf("cuda: %s: %s (%d)", e.Op, e.Name, e.Code) }

// DevicePtr is a device address (CUdeviceptr).
type DevicePtr uint64

// IPCHandle is a CUipcMemHandle: 64 opaque bytes another process opens.
type IPCHandle [64]byte

// Stream is a CUstream (non-blocking).
type Stream uintptr

// Copy is one device-to-device copy.
type Copy struct {
	Dst, Src DevicePtr
	Len      uint64
}

// Driver is what vllm-hi needs from CUDA. Methods that take a device make
// its primary context current on the calling OS thread first.
type Driver interface {
	// DeviceCount is the number of visible GPUs.
	DeviceCount() (int, error)
	// DeviceName is a GPU's name.
	DeviceName(dev int) (string, error)
	// DeviceUUID is a GPU's UUID as NVML and nvidia-smi print it
	// ("GPU-…"): unlike the ordinal, the same in every process whatever
	// CUDA_VISIBLE_DEVICES renumbers.
	DeviceUUID(dev int) (string, error)
	// Alloc allocates n bytes on dev (cuMemAlloc: 2 MiB aligned for large
	// sizes).
	Alloc(dev int, n uint64) (DevicePtr, error)
	Free(dev int, p DevicePtr) error
	// HtoD and DtoH copy synchronously between host memory and dev.
	HtoD(dev int, dst DevicePtr, src []byte) error
	DtoH(dev int, dst []byte, src DevicePtr) error
	// IPCGet exports an allocation's base; IPCOpen maps another process's
	// allocation into dev's context (peer access enabled lazily);
	// IPCClose unmaps it.
	IPCGet(dev int, p DevicePtr) (IPCHandle, error)
	IPCOpen(dev int, h IPCHandle) (DevicePtr, error)
	IPCClose(dev int, p DevicePtr) error
	// NewStream makes a non-blocking stream on dev.
	NewStream(dev int) (Stream, error)
	DestroyStream(dev int, s Stream) error
	// CopyBatch enqueues copies on s (one cuMemcpyBatchAsync where the
	// driver has it, else one cuMemcpyAsync per copy) and Sync waits.
	CopyBatch(dev int, s Stream, copies []Copy) error
	Sync(dev int, s Stream) error
	// EnablePeer lets dev's context address peer's memory directly.
	EnablePeer(dev, peer int) error
	// KernelCopy runs copies with one kernel launch (16-byte aligned).
	KernelCopy(dev int, s Stream, copies []Copy) error
	// KernelCopyFill runs n copies with the copy kernel, fill writing
	// their descriptors chunk by chunk (EachChunk's chunks, in order)
	// where the launch reads them: no list of n copies is built first.
	KernelCopyFill(dev int, s Stream, n int, fill func(chunk []Copy)) error
	// HostAlloc and HostFree manage page-locked host memory; HtoDAsync
	// and DtoHAsync copy between it and dev on s.
	HostAlloc(dev int, n uint64) ([]byte, error)
	HostFree(dev int, b []byte) error
	HtoDAsync(dev int, s Stream, dst DevicePtr, src []byte) error
	DtoHAsync(dev int, s Stream, dst []byte, src DevicePtr) error
	// HasBatchCopy reports whether cuMemcpyBatchAsync is available.
	HasBatchCopy() bool
	// Close releases this reference to the library.
	Close() error
}

// EachChunk calls f with the consecutive chunks [lo, hi) that cut n
// descriptors for KernelCopyFill: a small first chunk, so that the GPU
// starts copying while the host writes the next, then chunks doubling to
// 64 Ki descriptors (1.5 MiB; a launch and an upload each).
func EachChunk(n int, f func(lo, hi int) error) error {
	size := 4096
	for lo := 0; lo < n; {
		hi := min(lo+size, n)
		if err := f(lo, hi); err != nil {
			return err
		}
		lo, size = hi, min(2*size, 65536)
	}
	return nil
}

// FilledCopies is KernelCopyFill's list built in Go memory, chunk by chunk
// as the GPU path fills it: drivers without a GPU (tests) pass it on to
// their KernelCopy.
func FilledCopies(n int, fill func(chunk []Copy)) []Copy {
	out := make([]Copy, n)
	_ = EachChunk(n, func(lo, hi int) error { fill(out[lo:hi]); return nil })
	return out
}

// Aligned says whether every copy's addresses and length are multiples of
// 16 (what the copy kernel moves).
func Aligned(copies []Copy) bool {
	var or uint64
	for _, c := range copies {
		or |= uint64(c.Dst) | uint64(c.Src) | c.Len
	}
	return or%16 == 0
}

// FormatUUID writes a CUuuid the way NVML and nvidia-smi do:
// GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
func FormatUUID(b [16]byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// SumTask is one block's slot range in one region of an engine's KV, for
// the integrity check's hash kernel (Summer): Base addresses the block's
// first layer, K, first head and first slot of the range in the region;
// the strides step from there; its sum goes to sums[Out]. Layers and heads
// are the region's, numbered as the model's (FirstLayer, FirstHead).
type SumTask struct {
	Base                                          DevicePtr
	LayerStride, KVStride, HeadStride, SlotStride uint64
	FirstLayer, NumLayers, FirstHead, NumHeads    uint32
	Slots                                         uint32
	Out                                           uint32
}

// SumShape is what every task of one KVSum call shares: the model's KV
// heads and the 8-byte words in one head's slot (even).
type SumShape struct {
	KVHeads, Words uint32
}

// ErrSumShape is returned by KVSum for tasks the kernel cannot read: a
// head's slot not whole 16-byte pairs, or an address or stride not on a
// 16-byte boundary (the caller hashes another way).
var ErrSumShape = errors.New("cuda: the KV sum kernel needs 16-byte aligned head slots and strides")

// Summer is a Driver that runs the integrity check's hash on the GPU
// (internal/kvsum's scheme): every task's words summed into sums (zeroed
// first), in one kernel launch, on dev's stream s; it returns when sums
// hold the result.
type Summer interface {
	KVSum(dev int, s Stream, shape SumShape, tasks []SumTask, sums []uint64) error
}

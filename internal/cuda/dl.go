package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// The few driver API types used here, declared locally so that building
// needs no CUDA headers (their layout is part of the driver's stable ABI).
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { int type; int id; } CUmemLocation;
typedef struct {
	int srcAccessOrder;
	CUmemLocation srcLocHint;
	CUmemLocation dstLocHint;
	unsigned int flags;
} CUmemcpyAttributes;

#define VHI_MAX_DEV 64
#define CU_STREAM_NON_BLOCKING 1
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1
#define CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define VHI_NOT_LOADED -1

static void *vhi_lib;
static CUcontext vhi_ctx[VHI_MAX_DEV];

static CUresult (*p_getProc)(const char *, void **, int, unsigned long long, int *);
static CUresult (*p_init)(unsigned int);
static CUresult (*p_errName)(CUresult, const char **);
static CUresult (*p_devCount)(int *);
static CUresult (*p_devGet)(CUdevice *, int);
static CUresult (*p_devName)(char *, int, CUdevice);
static CUresult (*p_devUuid)(unsigned char *, CUdevice); // CUuuid *: 16 bytes
static CUresult (*p_ctxRetain)(CUcontext *, CUdevice);
static CUresult (*p_ctxSet)(CUcontext);
static CUresult (*p_alloc)(CUdeviceptr *, size_t);
static CUresult (*p_free)(CUdeviceptr);
static CUresult (*p_htod)(CUdeviceptr, const void *, size_t);
static CUresult (*p_dtoh)(void *, CUdeviceptr, size_t);
static CUresult (*p_ipcGet)(CUipcMemHandle *, CUdeviceptr);
static CUresult (*p_ipcOpen)(CUdeviceptr *, CUipcMemHandle, unsigned int);
static CUresult (*p_ipcClose)(CUdeviceptr);
static CUresult (*p_streamCreate)(CUstream *, unsigned int);
static CUresult (*p_streamDestroy)(CUstream);
static CUresult (*p_streamSync)(CUstream);
static CUresult (*p_memcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
static CUresult (*p_peer)(CUcontext, unsigned int);
static CUresult (*p_modLoad)(void **, const void *);
static CUresult (*p_modFn)(void **, void *, const char *);
static CUresult (*p_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
static CUresult (*p_htodAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_dtohAsync)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*p_hostAlloc)(void **, size_t);
static CUresult (*p_hostFree)(void *);
static CUresult (*p_eventCreate)(CUevent *, unsigned int);
static CUresult (*p_eventRecord)(CUevent, CUstream);
static CUresult (*p_eventSync)(CUevent);
static CUresult (*p_eventElapsed)(float *, CUevent, CUevent);
static CUresult (*p_eventDestroy)(CUevent);
static void *vhi_fn[VHI_MAX_DEV];
static void *vhi_fnw[VHI_MAX_DEV];
static void *vhi_sum_fn[VHI_MAX_DEV];
static CUresult (*p_batch)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, CUmemcpyAttributes *, size_t *, size_t, size_t *, CUstream);

// vhi_sym resolves a driver entry point at the ABI of CUDA 12.8 through
// cuGetProcAddress (the driver's way to hand out versioned symbols such as
// cuMemAlloc_v2), falling back to dlsym of the plain name.
static void *vhi_sym(const char *name) {
	void *p = NULL;
	int status = 0;
	if (p_getProc != NULL && p_getProc(name, &p, 12080, 0, &status) == 0 && p != NULL) return p;
	return dlsym(vhi_lib, name);
}

static int vhi_open(void) {
	if (vhi_lib != NULL) return 0;
	vhi_lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (vhi_lib == NULL) return 1;
	p_getProc = dlsym(vhi_lib, "cuGetProcAddress_v2");
#define SYM(var, name) var = vhi_sym(name); if (var == NULL) { dlclose(vhi_lib); vhi_lib = NULL; return 2; }
	SYM(p_init, "cuInit")
	SYM(p_errName, "cuGetErrorName")
	SYM(p_devCount, "cuDeviceGetCount")
	SYM(p_devGet, "cuDeviceGet")
	SYM(p_devName, "cuDeviceGetName")
	SYM(p_devUuid, "cuDeviceGetUuid") // _v2 through cuGetProcAddress at 12.8
	SYM(p_ctxRetain, "cuDevicePrimaryCtxRetain")
	SYM(p_ctxSet, "cuCtxSetCurrent")
	SYM(p_alloc, "cuMemAlloc")
	SYM(p_free, "cuMemFree")
	SYM(p_htod, "cuMemcpyHtoD")
	SYM(p_dtoh, "cuMemcpyDtoH")
	SYM(p_ipcGet, "cuIpcGetMemHandle")
	SYM(p_ipcOpen, "cuIpcOpenMemHandle")
	SYM(p_ipcClose, "cuIpcCloseMemHandle")
	SYM(p_streamCreate, "cuStreamCreate")
	SYM(p_streamDestroy, "cuStreamDestroy")
	SYM(p_streamSync, "cuStreamSynchronize")
	SYM(p_memcpyAsync, "cuMemcpyAsync")
	SYM(p_peer, "cuCtxEnablePeerAccess")
	SYM(p_modLoad, "cuModuleLoadData")
	SYM(p_modFn, "cuModuleGetFunction")
	SYM(p_launch, "cuLaunchKernel")
	SYM(p_htodAsync, "cuMemcpyHtoDAsync")
	SYM(p_dtohAsync, "cuMemcpyDtoHAsync")
	SYM(p_hostAlloc, "cuMemAllocHost")
	SYM(p_hostFree, "cuMemFreeHost")
	SYM(p_eventCreate, "cuEventCreate")
	SYM(p_eventRecord, "cuEventRecord")
	SYM(p_eventSync, "cuEventSynchronize")
	SYM(p_eventElapsed, "cuEventElapsedTime")
	SYM(p_eventDestroy, "cuEventDestroy")
#undef SYM
	p_batch = vhi_sym("cuMemcpyBatchAsync"); // CUDA 12.8+; optional
	memset(vhi_ctx, 0, sizeof vhi_ctx);
	memset(vhi_fn, 0, sizeof vhi_fn);
	memset(vhi_fnw, 0, sizeof vhi_fnw);
	memset(vhi_sum_fn, 0, sizeof vhi_sum_fn);

	return p_init(0) == 0 ? 0 : 3;
}

static void vhi_close(void) {
	// Primary contexts stay retained for the process's life: releasing
	// them would free memory other references may still use.
	if (vhi_lib != NULL) dlclose(vhi_lib);
	vhi_lib = NULL;
}

static int vhi_has_batch(void) { return p_batch != NULL; }

static const char *vhi_err_name(CUresult r) {
	const char *s = NULL;
	if (p_errName == NULL || p_errName(r, &s) != 0 || s == NULL) return "CUDA_ERROR_UNKNOWN";
	return s;
}

// vhi_dev makes dev's primary context current on this OS thread. Every
// wrapper below calls it in the same cgo call as its operation, so the
// goroutine cannot move threads in between.
static CUresult vhi_dev(int dev) {
	if (vhi_lib == NULL) return VHI_NOT_LOADED;
	if (dev < 0 || dev >= VHI_MAX_DEV) return 101; // CUDA_ERROR_INVALID_DEVICE
	if (vhi_ctx[dev] == NULL) {
		CUdevice d;
		CUresult r = p_devGet(&d, dev);
		if (r) return r;
		r = p_ctxRetain(&vhi_ctx[dev], d);
		if (r) return r;
	}
	return p_ctxSet(vhi_ctx[dev]);
}

static CUresult w_count(int *n) { if (vhi_lib == NULL) return VHI_NOT_LOADED; return p_devCount(n); }
static CUresult w_name(int dev, char *buf, int len) {
	CUdevice d; CUresult r;
	if (vhi_lib == NULL) return VHI_NOT_LOADED;
	if ((r = p_devGet(&d, dev))) return r;
	return p_devName(buf, len, d);
}
static CUresult w_uuid(int dev, unsigned char *out) {
	CUdevice d; CUresult r;
	if (vhi_lib == NULL) return VHI_NOT_LOADED;
	if ((r = p_devGet(&d, dev))) return r;
	return p_devUuid(out, d);
}
static CUresult w_alloc(int dev, size_t n, CUdeviceptr *p) { CUresult r = vhi_dev(dev); return r ? r : p_alloc(p, n); }
static CUresult w_free(int dev, CUdeviceptr p) { CUresult r = vhi_dev(dev); return r ? r : p_free(p); }
static CUresult w_htod(int dev, CUdeviceptr d, const void *s, size_t n) { CUresult r = vhi_dev(dev); return r ? r : p_htod(d, s, n); }
static CUresult w_dtoh(int dev, void *d, CUdeviceptr s, size_t n) { CUresult r = vhi_dev(dev); return r ? r : p_dtoh(d, s, n); }
static CUresult w_ipc_get(int dev, CUdeviceptr p, void *out) {
	CUipcMemHandle h; CUresult r = vhi_dev(dev);
	if (r || (r = p_ipcGet(&h, p))) return r;
	memcpy(out, &h, sizeof h);
	return 0;
}
static CUresult w_ipc_open(int dev, const void *in, CUdeviceptr *p) {
	CUipcMemHandle h; CUresult r = vhi_dev(dev);
	if (r) return r;
	memcpy(&h, in, sizeof h);
	return p_ipcOpen(p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}
static CUresult w_ipc_close(int dev, CUdeviceptr p) { CUresult r = vhi_dev(dev); return r ? r : p_ipcClose(p); }
static CUresult w_stream(int dev, uintptr_t *s) {
	CUstream st; CUresult r = vhi_dev(dev);
	if (r || (r = p_streamCreate(&st, CU_STREAM_NON_BLOCKING))) return r;
	*s = (uintptr_t)st;
	return 0;
}
static CUresult w_stream_destroy(int dev, uintptr_t s) { CUresult r = vhi_dev(dev); return r ? r : p_streamDestroy((CUstream)s); }
static CUresult w_sync(int dev, uintptr_t s) { CUresult r = vhi_dev(dev); return r ? r : p_streamSync((CUstream)s); }

// w_copies enqueues n copies: one cuMemcpyBatchAsync when available (one
// driver call for the lot), else one cuMemcpyAsync each, all in this one
// cgo call.
static CUresult w_copies(int dev, uintptr_t s, CUdeviceptr *dst, CUdeviceptr *src, size_t *len, size_t n, int batch) {
	CUresult r = vhi_dev(dev);
	if (r) return r;
	if (batch && p_batch != NULL) {
		CUmemcpyAttributes a;
		memset(&a, 0, sizeof a);
		a.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
		a.srcLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
		a.srcLocHint.id = dev;
		a.dstLocHint.type = CU_MEM_LOCATION_TYPE_DEVICE;
		a.dstLocHint.id = dev;
		size_t idx = 0, fail = 0;
		return p_batch(dst, src, len, n, &a, &idx, 1, &fail, (CUstream)s);
	}
	for (size_t i = 0; i < n; i++) {
		if ((r = p_memcpyAsync(dst[i], src[i], len[i], (CUstream)s))) return r;
	}
	return 0;
}

static CUresult w_htod_async(int dev, uintptr_t s, CUdeviceptr d, const void *h, size_t n) { CUresult r = vhi_dev(dev); return r ? r : p_htodAsync(d, h, n, (CUstream)s); }
static CUresult w_dtoh_async(int dev, uintptr_t s, void *h, CUdeviceptr d, size_t n) { CUresult r = vhi_dev(dev); return r ? r : p_dtohAsync(h, d, n, (CUstream)s); }
static CUresult w_host_alloc(int dev, size_t n, void **p) { CUresult r = vhi_dev(dev); return r ? r : p_hostAlloc(p, n); }
static CUresult w_host_free(int dev, void *p) { CUresult r = vhi_dev(dev); return r ? r : p_hostFree(p); }

// w_peer lets dev's context address peer's memory directly (NVLink or
// PCIe peer-to-peer) instead of staging through the host.
static CUresult w_peer(int dev, int peer) {
	CUresult r = vhi_dev(peer);
	if (r) return r;
	CUcontext pc = vhi_ctx[peer];
	if ((r = vhi_dev(dev))) return r;
	r = p_peer(pc, 0);
	return r == 704 ? 0 : r; // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
}

// w_kernel_copies runs n copies (dst, src, len triples, 16-byte aligned)
// with the vhi_copy kernel: one launch whatever n. The descriptors go to
// descbuf (the caller's, one per stream: copies on other streams may be in
// flight) on the same stream first.
static CUresult w_load_kernels(int dev, const char *ptx, const char *sum_ptx) {
	CUresult r = vhi_dev(dev);
	if (r || vhi_fn[dev] != NULL) return r;
	void *mod = NULL, *sum_mod = NULL;
	if ((r = p_modLoad(&sum_mod, sum_ptx))) return r;
	if ((r = p_modFn(&vhi_sum_fn[dev], sum_mod, "vhi_kvsum"))) return r;
	if ((r = p_modLoad(&mod, ptx))) return r;
	if ((r = p_modFn(&vhi_fnw[dev], mod, "vhi_copy_w"))) return r;
	return p_modFn(&vhi_fn[dev], mod, "vhi_copy");
}

// w_kvsum uploads n tasks of 64 bytes followed by the zeroed sums (host,
// host_bytes) to buf, runs vhi_kvsum over them (grid n × max_layers, 256
// threads), downloads the sums and waits for the stream.
static CUresult w_kvsum(int dev, uintptr_t s, CUdeviceptr buf, const void *host, size_t host_bytes, unsigned n, unsigned max_layers,
		unsigned heads, unsigned words, void *sums, size_t sum_bytes) {
	CUresult r = vhi_dev(dev);
	if (r) return r;
	if (vhi_sum_fn[dev] == NULL) return 3; // CUDA_ERROR_NOT_INITIALIZED: PrepareKernels first
	if ((r = p_htodAsync(buf, host, host_bytes, (CUstream)s))) return r;
	CUdeviceptr tasks = buf, out = buf + (CUdeviceptr)n * 64;
	void *args[5] = { &tasks, &n, &out, &heads, &words };
	if ((r = p_launch(vhi_sum_fn[dev], n, max_layers, 1, 256, 1, 1, 0, (CUstream)s, args, NULL))) return r;
	if ((r = p_dtohAsync(sums, out, sum_bytes, (CUstream)s))) return r;
	return p_streamSync((CUstream)s);
}

// w_kernel_copies uploads n descriptors from desc (page-locked: the
// upload is asynchronous, and uploaded records when it is done, so that
// the caller knows when desc may be written again) and launches the copy
// kernel over them: vhi_copy_w (a warp to a descriptor) where warp is
// set, else vhi_copy (a CTA to a descriptor).
// before and after, where not 0, are events recorded before the upload
// and after the launch (the upload's time and the kernel's, for
// benchmarks).
static CUresult w_kernel_copies(int dev, uintptr_t s, CUdeviceptr descbuf, const unsigned long long *desc, unsigned n, unsigned grid, unsigned block,
		int warp, uintptr_t uploaded, uintptr_t before, uintptr_t after) {
	CUresult r = vhi_dev(dev);
	if (r) return r;
	void *fn = warp ? vhi_fnw[dev] : vhi_fn[dev];
	if (fn == NULL) return 3; // CUDA_ERROR_NOT_INITIALIZED: PrepareKernels first
	if (before && (r = p_eventRecord((CUevent)before, (CUstream)s))) return r;
	if ((r = p_htodAsync(descbuf, desc, (size_t)n * 24, (CUstream)s))) return r;
	if ((r = p_eventRecord((CUevent)uploaded, (CUstream)s))) return r;
	void *args[2] = { &descbuf, &n };
	if ((r = p_launch(fn, grid, 1, 1, block, 1, 1, 0, (CUstream)s, args, NULL))) return r;
	if (after && (r = p_eventRecord((CUevent)after, (CUstream)s))) return r;
	return 0;
}

static CUresult w_event(int dev, uintptr_t *e) {
	CUevent ev; CUresult r = vhi_dev(dev);
	if (r || (r = p_eventCreate(&ev, 0))) return r;
	*e = (uintptr_t)ev;
	return 0;
}
static CUresult w_event_record(int dev, uintptr_t e, uintptr_t s) { CUresult r = vhi_dev(dev); return r ? r : p_eventRecord((CUevent)e, (CUstream)s); }
static CUresult w_event_sync(int dev, uintptr_t e) { CUresult r = vhi_dev(dev); return r ? r : p_eventSync((CUevent)e); }
static CUresult w_event_elapsed(int dev, uintptr_t a, uintptr_t b, float *ms) { CUresult r = vhi_dev(dev); return r ? r : p_eventElapsed(ms, (CUevent)a, (CUevent)b); }
static CUresult w_event_destroy(int dev, uintptr_t e) { CUresult r = vhi_dev(dev); return r ? r : p_eventDestroy((CUevent)e); }
*/
import "C"

import (
	_ "embed"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"
)

// copyPTX is the vhi_copy kernel (hand-written PTX, checked with ptxas;
// the driver compiles it for the GPU at first use).
//
//go:embed copy.ptx
var copyPTX string

var copyPTXC = func() *C.char { return C.CString(copyPTX) }()

// kvsumPTX is the vhi_kvsum kernel, the integrity check's hash (hand-written
// PTX like vhi_copy, checked with ptxas for sm_80 and sm_90).
//
//go:embed kvsum.ptx
var kvsumPTX string

var kvsumPTXC = func() *C.char { return C.CString(kvsumPTX) }()

// The C library handle is process-wide, so is its reference count.
var lib struct {
	mu   sync.Mutex
	refs int
}

// Lib is a reference to the loaded driver; it implements Driver.
type Lib struct {
	closed bool
	// descs are the kernel's descriptor buffers, one per stream (a
	// buffer shared by two streams would be overwritten mid-copy).
	descMu sync.Mutex
	descs  map[Stream]descBuf
	// hostDescs are the page-locked buffers the descriptors are written
	// to and uploaded from, one per stream, each with the event recorded
	// after its last upload.
	hostDescs map[Stream]hostDescBuf
	// ForceLoop makes CopyBatch issue one cuMemcpyAsync per copy even
	// where cuMemcpyBatchAsync exists (benchmarks compare the two).
	ForceLoop bool
	// CopyKernel is the kernel KernelCopy launches: KernelPerCTA or
	// KernelPerWarp (VLLM_HI_COPY_KERNEL at Load; benchmarks compare).
	CopyKernel string
	// ChunkedDescriptors makes KernelCopyFill write the descriptors in
	// chunks where each launch reads them (VLLM_HI_COPY_DESCRIPTORS=chunks
	// at Load); off, it builds the whole list first and launches once, as
	// the copier always did. Off by default until it is measured on a GPU
	// (benchmarks compare).
	ChunkedDescriptors bool
}

// The copy kernels (Lib.CopyKernel).
const (
	// KernelPerCTA is vhi_copy: a CTA of 512 threads to a descriptor.
	KernelPerCTA = "cta"
	// KernelPerWarp is vhi_copy_w: a warp to a descriptor, 4 KiB chunks.
	KernelPerWarp = "warp"
)

// CopyKernelEnv names the copy kernel a process's Lib launches.
const CopyKernelEnv = "VLLM_HI_COPY_KERNEL"

// CopyDescriptorsEnv says how a process's Lib hands a copy's descriptors
// to the kernel: "list" (the default) or "chunks" (Lib.ChunkedDescriptors).
const CopyDescriptorsEnv = "VLLM_HI_COPY_DESCRIPTORS"

var _ Driver = (*Lib)(nil)

// Load opens libcuda.so.1 (once per process) and initialises the driver.
// It returns ErrUnavailable where there is no CUDA driver.
func Load() (*Lib, error) {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	if lib.refs == 0 {
		switch C.vhi_open() {
		case 0:
		case 1:
			return nil, ErrUnavailable
		case 2:
			return nil, fmt.Errorf("cuda: libcuda.so.1 lacks a driver entry point vllm-hi needs (driver too old?)")
		default:
			C.vhi_close()
			return nil, fmt.Errorf("cuda: cuInit failed (no usable GPU?)")
		}
		// A fresh open forgot the kernels loaded before.
		kernels.mu.Lock()
		kernels.ready = nil
		kernels.mu.Unlock()
	}
	lib.refs++
	l := &Lib{CopyKernel: KernelPerCTA}
	var bad error
	switch k := os.Getenv(CopyKernelEnv); k {
	case "":
	case KernelPerCTA, KernelPerWarp:
		l.CopyKernel = k
	default:
		bad = fmt.Errorf("cuda: %s=%q: want %s or %s", CopyKernelEnv, k, KernelPerCTA, KernelPerWarp)
	}
	switch d := os.Getenv(CopyDescriptorsEnv); d {
	case "", "list":
	case "chunks":
		l.ChunkedDescriptors = true
	default:
		bad = fmt.Errorf("cuda: %s=%q: want list or chunks", CopyDescriptorsEnv, d)
	}
	if bad != nil {
		lib.refs--
		if lib.refs == 0 {
			C.vhi_close()
		}
		return nil, bad
	}
	return l, nil
}

// Close drops this reference; the library is unloaded with the last one.
func (l *Lib) Close() error {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	lib.refs--
	if lib.refs == 0 {
		C.vhi_close()
	}
	return nil
}

func (l *Lib) check(op string, r C.CUresult) error {
	switch {
	case r == 0:
		return nil
	case r == C.VHI_NOT_LOADED:
		return ErrNotLoaded
	}
	return &Error{Code: int(r), Name: C.GoString(C.vhi_err_name(r)), Op: op}
}

func (l *Lib) loaded() error {
	if l.closed {
		return ErrNotLoaded
	}
	return nil
}

func (l *Lib) DeviceCount() (int, error) {
	if err := l.loaded(); err != nil {
		return 0, err
	}
	var n C.int
	return int(n), l.check("cuDeviceGetCount", C.w_count(&n))
}

func (l *Lib) DeviceName(dev int) (string, error) {
	if err := l.loaded(); err != nil {
		return "", err
	}
	var buf [256]C.char
	if err := l.check("cuDeviceGetName", C.w_name(C.int(dev), &buf[0], C.int(len(buf)))); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

func (l *Lib) DeviceUUID(dev int) (string, error) {
	if err := l.loaded(); err != nil {
		return "", err
	}
	var raw [16]C.uchar
	if err := l.check("cuDeviceGetUuid", C.w_uuid(C.int(dev), &raw[0])); err != nil {
		return "", err
	}
	var b [16]byte
	for i, x := range raw {
		b[i] = byte(x)
	}
	return FormatUUID(b), nil
}

func (l *Lib) Alloc(dev int, n uint64) (DevicePtr, error) {
	if err := l.loaded(); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	err := l.check("cuMemAlloc", C.w_alloc(C.int(dev), C.size_t(n), &p))
	return DevicePtr(p), err
}

func (l *Lib) Free(dev int, p DevicePtr) error {
	if err := l.loaded(); err != nil {
		return err
	}
	return l.check("cuMemFree", C.w_free(C.int(dev), C.CUdeviceptr(p)))
}

func (l *Lib) HtoD(dev int, dst DevicePtr, src []byte) error {
	if err := l.loaded(); err != nil || len(src) == 0 {
		return err
	}
	return l.check("cuMemcpyHtoD", C.w_htod(C.int(dev), C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func (l *Lib) DtoH(dev int, dst []byte, src DevicePtr) error {
	if err := l.loaded(); err != nil || len(dst) == 0 {
		return err
	}
	return l.check("cuMemcpyDtoH", C.w_dtoh(C.int(dev), unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst))))
}

func (l *Lib) IPCGet(dev int, p DevicePtr) (IPCHandle, error) {
	var h IPCHandle
	if err := l.loaded(); err != nil {
		return h, err
	}
	err := l.check("cuIpcGetMemHandle", C.w_ipc_get(C.int(dev), C.CUdeviceptr(p), unsafe.Pointer(&h[0])))
	return h, err
}

func (l *Lib) IPCOpen(dev int, h IPCHandle) (DevicePtr, error) {
	if err := l.loaded(); err != nil {
		return 0, err
	}
	var p C.CUdeviceptr
	err := l.check("cuIpcOpenMemHandle", C.w_ipc_open(C.int(dev), unsafe.Pointer(&h[0]), &p))
	return DevicePtr(p), err
}

func (l *Lib) IPCClose(dev int, p DevicePtr) error {
	if err := l.loaded(); err != nil {
		return err
	}
	return l.check("cuIpcCloseMemHandle", C.w_ipc_close(C.int(dev), C.CUdeviceptr(p)))
}

func (l *Lib) NewStream(dev int) (Stream, error) {
	if err := l.loaded(); err != nil {
		return 0, err
	}
	var s C.uintptr_t
	err := l.check("cuStreamCreate", C.w_stream(C.int(dev), &s))
	return Stream(s), err
}

func (l *Lib) DestroyStream(dev int, s Stream) error {
	if err := l.loaded(); err != nil {
		return err
	}
	l.descMu.Lock()
	if b, ok := l.descs[s]; ok {
		_ = l.sync(dev, s)
		_ = l.Free(b.dev, b.ptr)
		delete(l.descs, s)
	}
	if h, ok := l.hostDescs[s]; ok {
		_ = l.sync(dev, s)
		_ = l.HostFree(h.dev, h.buf)
		_ = l.check("cuEventDestroy", C.w_event_destroy(C.int(h.dev), C.uintptr_t(h.uploaded)))
		delete(l.hostDescs, s)
	}
	l.descMu.Unlock()
	return l.check("cuStreamDestroy", C.w_stream_destroy(C.int(dev), C.uintptr_t(s)))
}

func (l *Lib) Sync(dev int, s Stream) error {
	if err := l.loaded(); err != nil {
		return err
	}
	return l.sync(dev, s)
}

func (l *Lib) sync(dev int, s Stream) error {
	return l.check("cuStreamSynchronize", C.w_sync(C.int(dev), C.uintptr_t(s)))
}

func (l *Lib) HasBatchCopy() bool { return !l.closed && C.vhi_has_batch() != 0 }

// CopyBatch enqueues copies on s in one cgo call.
func (l *Lib) CopyBatch(dev int, s Stream, copies []Copy) error {
	if err := l.loaded(); err != nil || len(copies) == 0 {
		return err
	}
	// Plain uint64 arrays: no Go pointers inside, so C may read them.
	buf := make([]uint64, 3*len(copies))
	dst, src, n := buf[:len(copies)], buf[len(copies):2*len(copies)], buf[2*len(copies):]
	for i, c := range copies {
		dst[i], src[i], n[i] = uint64(c.Dst), uint64(c.Src), c.Len
	}
	batch := C.int(1)
	op := "cuMemcpyBatchAsync"
	if l.ForceLoop || !l.HasBatchCopy() {
		batch, op = 0, "cuMemcpyAsync"
	}
	return l.check(op, C.w_copies(C.int(dev), C.uintptr_t(s), (*C.CUdeviceptr)(unsafe.Pointer(&dst[0])),
		(*C.CUdeviceptr)(unsafe.Pointer(&src[0])), (*C.size_t)(unsafe.Pointer(&n[0])), C.size_t(len(copies)), batch))
}

func (l *Lib) EnablePeer(dev, peer int) error {
	if err := l.loaded(); err != nil || dev == peer {
		return err
	}
	return l.check("cuCtxEnablePeerAccess", C.w_peer(C.int(dev), C.int(peer)))
}

// KernelCopy runs copies with one launch of the copy kernel on dev's
// stream, whatever their number (small blocks need it: a copy-engine call
// costs microseconds each). The descriptors are written to page-locked
// memory and uploaded asynchronously before the launch. Every address and
// length must be a multiple of 16 (ErrUnaligned otherwise).
func (l *Lib) KernelCopy(dev int, s Stream, copies []Copy) error {
	_, _, err := l.kernelCopy(dev, s, copies, false)
	return err
}

// KernelCopyTimed is KernelCopy followed by a wait for the stream, with
// the GPU's time for the descriptors' upload and for the kernel.
func (l *Lib) KernelCopyTimed(dev int, s Stream, copies []Copy) (upload, kernel time.Duration, err error) {
	return l.kernelCopy(dev, s, copies, true)
}

func (l *Lib) kernelCopy(dev int, s Stream, copies []Copy, timed bool) (upload, kernel time.Duration, err error) {
	if err := l.loaded(); err != nil || len(copies) == 0 {
		return 0, 0, err
	}
	if !Aligned(copies) {
		return 0, 0, ErrUnaligned
	}
	if err := l.PrepareKernels(dev); err != nil {
		return 0, 0, err
	}
	// The stream's descriptor buffers are one each: the upload of these
	// descriptors and the launch that reads them must not interleave with
	// another goroutine's on the same stream (two tcp_shm connections
	// flushing into one target share its device's stream). Interleaved,
	// both launches read the later upload, and the earlier copies never
	// happen: whole blocks missing on the target, which the integrity
	// check caught intermittently on the GPU (issue 30). Once both are
	// enqueued, the stream's order keeps the next upload behind this
	// launch.
	l.descMu.Lock()
	defer l.descMu.Unlock()
	n := uint64(len(copies)) * 24
	buf, err := l.descBufferLocked(dev, s, n)
	if err != nil {
		return 0, 0, err
	}
	h, err := l.hostDescLocked(dev, s, n)
	if err != nil {
		return 0, 0, err
	}
	var before, after C.uintptr_t
	if timed {
		for _, e := range []*C.uintptr_t{&before, &after} {
			if err := l.check("cuEventCreate", C.w_event(C.int(dev), e)); err != nil {
				return 0, 0, err
			}
			defer C.w_event_destroy(C.int(dev), *e)
		}
	}
	// A Copy is laid out as the kernel's descriptor (dst, src, len: three
	// u64, checked below at compile time), so the descriptors are one
	// copy of the slice's bytes.
	desc := unsafe.Slice((*Copy)(unsafe.Pointer(&h.buf[0])), len(copies))
	copy(desc, copies)
	warp, block, grid := l.launchShape(len(copies))
	if err := l.check("vhi_copy", C.w_kernel_copies(C.int(dev), C.uintptr_t(s), C.CUdeviceptr(buf),
		(*C.ulonglong)(unsafe.Pointer(&h.buf[0])), C.uint(len(copies)), C.uint(grid), C.uint(block), warp, C.uintptr_t(h.uploaded), before, after)); err != nil || !timed {
		return 0, 0, err
	}
	if err := l.check("cuEventSynchronize", C.w_event_sync(C.int(dev), after)); err != nil {
		return 0, 0, err
	}
	var up, k C.float
	if err := l.check("cuEventElapsedTime", C.w_event_elapsed(C.int(dev), before, C.uintptr_t(h.uploaded), &up)); err != nil {
		return 0, 0, err
	}
	if err := l.check("cuEventElapsedTime", C.w_event_elapsed(C.int(dev), C.uintptr_t(h.uploaded), after, &k)); err != nil {
		return 0, 0, err
	}
	ms := func(f C.float) time.Duration { return time.Duration(float64(f) * float64(time.Millisecond)) }
	return ms(up), ms(k), nil
}

// KernelCopyFill runs n copies with the copy kernel, their descriptors
// written by fill straight into the stream's page-locked buffer, a chunk
// at a time (EachChunk): each chunk's upload and launch are enqueued as
// soon as it is written, so the GPU copies the first chunks while fill
// writes the next, and no list of n copies is allocated, written and
// copied again. A chunk with an address or length off 16 bytes stops the
// call with ErrUnaligned (the chunks before it were enqueued: the caller
// checks alignment first where it must fall back).
//
// Without ChunkedDescriptors it is KernelCopy of the whole list, built
// first (the same chunks of fill into Go memory).
func (l *Lib) KernelCopyFill(dev int, s Stream, n int, fill func(chunk []Copy)) error {
	if err := l.loaded(); err != nil || n == 0 {
		return err
	}
	if !l.ChunkedDescriptors {
		return l.KernelCopy(dev, s, FilledCopies(n, fill))
	}
	if err := l.PrepareKernels(dev); err != nil {
		return err
	}
	l.descMu.Lock() // as in kernelCopy: one upload-and-launch at a time per stream
	defer l.descMu.Unlock()
	bytes := uint64(n) * 24
	buf, err := l.descBufferLocked(dev, s, bytes)
	if err != nil {
		return err
	}
	h, err := l.hostDescLocked(dev, s, bytes)
	if err != nil {
		return err
	}
	desc := unsafe.Slice((*Copy)(unsafe.Pointer(&h.buf[0])), n)
	return EachChunk(n, func(lo, hi int) error {
		chunk := desc[lo:hi]
		fill(chunk)
		if !Aligned(chunk) {
			return ErrUnaligned
		}
		m := hi - lo
		warp, block, grid := l.launchShape(m)
		return l.check("vhi_copy", C.w_kernel_copies(C.int(dev), C.uintptr_t(s), C.CUdeviceptr(buf)+C.CUdeviceptr(lo*24),
			(*C.ulonglong)(unsafe.Pointer(&chunk[0])), C.uint(m), C.uint(grid), C.uint(block), warp, C.uintptr_t(h.uploaded), 0, 0))
	})
}

// launchShape is the copy kernel's launch for n descriptors: whether it
// is the per-warp kernel, threads per CTA, CTAs.
func (l *Lib) launchShape(n int) (warp C.int, block, grid int) {
	if l.CopyKernel == KernelPerWarp {
		return 1, 256, min((n+7)/8, 132*32)
	}
	return 0, 512, min(n, 132*16)
}

// A Copy is the copy kernel's descriptor, byte for byte.
var _ = [1]struct{}{}[unsafe.Sizeof(Copy{})-24+unsafe.Offsetof(Copy{}.Src)-8+unsafe.Offsetof(Copy{}.Len)-16]

type hostDescBuf struct {
	dev      int
	buf      []byte
	uploaded uintptr // a CUevent
}

// hostDescLocked returns stream s's page-locked descriptor buffer, at
// least n bytes, once its last upload is done (l.descMu held).
func (l *Lib) hostDescLocked(dev int, s Stream, n uint64) (hostDescBuf, error) {
	if l.hostDescs == nil {
		l.hostDescs = map[Stream]hostDescBuf{}
	}
	h, ok := l.hostDescs[s]
	if !ok {
		var e C.uintptr_t
		if err := l.check("cuEventCreate", C.w_event(C.int(dev), &e)); err != nil {
			return h, err
		}
		h = hostDescBuf{dev: dev, uploaded: uintptr(e)}
	} else if err := l.check("cuEventSynchronize", C.w_event_sync(C.int(h.dev), C.uintptr_t(h.uploaded))); err != nil {
		return h, err
	}
	if uint64(len(h.buf)) < n {
		if h.buf != nil {
			_ = l.HostFree(h.dev, h.buf)
			h.buf = nil
		}
		b, err := l.HostAlloc(dev, max(n*2, 1<<20))
		if err != nil {
			delete(l.hostDescs, s)
			_ = l.check("cuEventDestroy", C.w_event_destroy(C.int(dev), C.uintptr_t(h.uploaded)))
			return h, err
		}
		h.buf = b
	}
	l.hostDescs[s] = h
	return h, nil
}

var _ Summer = (*Lib)(nil)

// KVSum runs the vhi_kvsum kernel over tasks on dev's stream s: one launch
// for a whole check, each task's words added to sums[task.Out] (every sum
// zeroed first). It returns once the sums are back (ErrSumShape for what
// the kernel cannot read).
func (l *Lib) KVSum(dev int, s Stream, shape SumShape, tasks []SumTask, sums []uint64) error {
	if err := l.loaded(); err != nil {
		return err
	}
	clear(sums)
	if len(tasks) == 0 {
		return nil
	}
	if shape.Words == 0 || shape.Words%2 != 0 {
		return ErrSumShape
	}
	// The tasks as the kernel reads them (64 bytes each, two u32 to a
	// u64, little-endian), then the sums it adds into, zeroed.
	buf := make([]uint64, 8*len(tasks)+len(sums))
	maxLayers := uint32(0)
	for i, t := range tasks {
		if (uint64(t.Base)|t.LayerStride|t.KVStride|t.HeadStride|t.SlotStride)%16 != 0 {
			return ErrSumShape
		}
		if int(t.Out) >= len(sums) {
			return fmt.Errorf("cuda: KV sum task %d adds to sum %d of %d", i, t.Out, len(sums))
		}
		d := buf[8*i : 8*i+8]
		d[0], d[1], d[2], d[3], d[4] = uint64(t.Base), t.LayerStride, t.KVStride, t.HeadStride, t.SlotStride
		d[5] = uint64(t.FirstLayer) | uint64(t.NumLayers)<<32
		d[6] = uint64(t.FirstHead) | uint64(t.NumHeads)<<32
		d[7] = uint64(t.Slots) | uint64(t.Out)<<32
		maxLayers = max(maxLayers, t.NumLayers)
	}
	if maxLayers == 0 || maxLayers > 65535 {
		return fmt.Errorf("cuda: KV sum tasks of %d layers", maxLayers)
	}
	if err := l.PrepareKernels(dev); err != nil {
		return err
	}
	// The stream's descriptor buffer (KernelCopy's): the call waits for
	// the stream before it lets the buffer go.
	l.descMu.Lock()
	defer l.descMu.Unlock()
	dbuf, err := l.descBufferLocked(dev, s, uint64(len(buf))*8)
	if err != nil {
		return err
	}
	out := make([]uint64, len(sums))
	if err := l.check("vhi_kvsum", C.w_kvsum(C.int(dev), C.uintptr_t(s), C.CUdeviceptr(dbuf), unsafe.Pointer(&buf[0]), C.size_t(len(buf)*8),
		C.uint(len(tasks)), C.uint(maxLayers), C.uint(shape.KVHeads), C.uint(shape.Words), unsafe.Pointer(&out[0]), C.size_t(len(out)*8))); err != nil {
		return err
	}
	copy(sums, out)
	return nil
}

// PrepareKernels loads the copy and sum kernels into dev's context now instead of
// at its first launch: the driver compiles the PTX then, which must not
// land in a migration target's first step or a final copy round.
func (l *Lib) PrepareKernels(dev int) error {
	if err := l.loaded(); err != nil {
		return err
	}
	kernels.mu.Lock()
	defer kernels.mu.Unlock()
	if kernels.ready[dev] {
		return nil
	}
	if err := l.check("cuModuleLoadData", C.w_load_kernels(C.int(dev), copyPTXC, kvsumPTXC)); err != nil {
		return err
	}
	if kernels.ready == nil {
		kernels.ready = map[int]bool{}
	}
	kernels.ready[dev] = true
	return nil
}

// kernels records the devices whose context has the copy kernel; like the
// C side's function handles it is process-wide.
var kernels struct {
	mu    sync.Mutex
	ready map[int]bool
}

type descBuf struct {
	dev int
	ptr DevicePtr
	cap uint64
}

// descBufferLocked returns stream s's descriptor buffer, grown to n
// bytes (l.descMu held). A stream runs its work in order, so the old
// buffer is free once the stream drained.
func (l *Lib) descBufferLocked(dev int, s Stream, n uint64) (DevicePtr, error) {
	if l.descs == nil {
		l.descs = map[Stream]descBuf{}
	}
	b := l.descs[s]
	if b.cap >= n {
		return b.ptr, nil
	}
	if b.ptr != 0 {
		if err := l.Sync(dev, s); err != nil {
			return 0, err
		}
		_ = l.Free(b.dev, b.ptr)
	}
	c := max(n*2, 1<<20)
	p, err := l.Alloc(dev, c)
	if err != nil {
		delete(l.descs, s)
		return 0, err
	}
	l.descs[s] = descBuf{dev: dev, ptr: p, cap: c}
	return p, nil
}

// HostAlloc allocates n bytes of page-locked host memory (fast, truly
// asynchronous copies). The slice is not Go memory: free it with HostFree
// and never store Go pointers in it.
func (l *Lib) HostAlloc(dev int, n uint64) ([]byte, error) {
	if err := l.loaded(); err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	if err := l.check("cuMemAllocHost", C.w_host_alloc(C.int(dev), C.size_t(n), &p)); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), n), nil
}

// HostFree frees HostAlloc memory.
func (l *Lib) HostFree(dev int, b []byte) error {
	if err := l.loaded(); err != nil || len(b) == 0 {
		return err
	}
	return l.check("cuMemFreeHost", C.w_host_free(C.int(dev), unsafe.Pointer(&b[0])))
}

// HtoDAsync and DtoHAsync enqueue copies on s (src/dst should be
// HostAlloc memory for them to be asynchronous).
func (l *Lib) HtoDAsync(dev int, s Stream, dst DevicePtr, src []byte) error {
	if err := l.loaded(); err != nil || len(src) == 0 {
		return err
	}
	return l.check("cuMemcpyHtoDAsync", C.w_htod_async(C.int(dev), C.uintptr_t(s), C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

func (l *Lib) DtoHAsync(dev int, s Stream, dst []byte, src DevicePtr) error {
	if err := l.loaded(); err != nil || len(dst) == 0 {
		return err
	}
	return l.check("cuMemcpyDtoHAsync", C.w_dtoh_async(C.int(dev), C.uintptr_t(s), unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst))))
}

package rdma

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

// The UCP types vllm-hi uses, declared here so that building needs no UCX
// headers. Every parameter struct starts with a field_mask and the
// library reads only the fields the mask names, so each mirror declares
// the leading fields vllm-hi sets, at their ABI offsets (checked against
// the real headers by TestStructLayoutMatchesHeaders), and padding.
typedef int ucs_status_t;
typedef struct { uint64_t field_mask; uint64_t features; char pad[256]; } vhi_ucp_params;
typedef struct { uint64_t field_mask; int thread_mode; char pad[256]; } vhi_ucp_worker_params;
typedef struct {
	uint64_t field_mask;
	const void *address;
	int err_mode;
	void (*err_cb)(void *arg, void *ep, ucs_status_t status);
	void *err_arg;
	char pad[256];
} vhi_ucp_ep_params;
typedef struct { uint64_t field_mask; void *address; size_t length; char pad[256]; } vhi_ucp_mem_map_params;
typedef struct { uint32_t op_attr_mask; uint32_t flags; char pad[256]; } vhi_ucp_request_param;

#define VHI_UCP_API_MAJOR 1
#define VHI_UCP_API_MINOR 13
#define VHI_UCP_PARAM_FIELD_FEATURES (1ULL << 0)
#define VHI_UCP_FEATURE_RMA (1ULL << 1)
#define VHI_UCP_WORKER_PARAM_FIELD_THREAD_MODE (1ULL << 0)
#define VHI_UCS_THREAD_MODE_SERIALIZED 1
#define VHI_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS (1ULL << 0)
#define VHI_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE (1ULL << 1)
#define VHI_UCP_EP_PARAM_FIELD_ERR_HANDLER (1ULL << 2)
#define VHI_UCP_ERR_HANDLING_MODE_PEER 1
#define VHI_UCP_MEM_MAP_PARAM_FIELD_ADDRESS (1ULL << 0)
#define VHI_UCP_MEM_MAP_PARAM_FIELD_LENGTH (1ULL << 1)
#define VHI_UCP_OP_ATTR_FIELD_FLAGS (1U << 4)
#define VHI_UCP_EP_CLOSE_FLAG_FORCE 1U
#define VHI_UCS_OK 0
#define VHI_UCS_INPROGRESS 1
#define VHI_UCS_ERR_TIMED_OUT -20
#define VHI_UCS_ERR_LAST -100
#define VHI_NOT_LOADED -1000
#define VHI_PTR_IS_ERR(p) (((uintptr_t)(p)) >= ((uintptr_t)VHI_UCS_ERR_LAST))
#define VHI_PTR_IS_PTR(p) (((uintptr_t)(p) - 1) < ((uintptr_t)VHI_UCS_ERR_LAST - 1))
#define VHI_PTR_STATUS(p) ((ucs_status_t)(intptr_t)(p))

static void *vhi_ucp;
static ucs_status_t (*p_config_read)(const char *, const char *, void **);
static void (*p_config_release)(void *);
static ucs_status_t (*p_init_version)(unsigned, unsigned, const void *, const void *, void **);
static void (*p_cleanup)(void *);
static void (*p_context_print_info)(void *, FILE *);
static const char *(*p_version_string)(void);
static ucs_status_t (*p_worker_create)(void *, const void *, void **);
static void (*p_worker_destroy)(void *);
static ucs_status_t (*p_worker_get_address)(void *, void **, size_t *);
static void (*p_worker_release_address)(void *, void *);
static unsigned (*p_worker_progress)(void *);
static ucs_status_t (*p_ep_create)(void *, const void *, void **);
static void *(*p_ep_close_nbx)(void *, const void *);
static void *(*p_ep_flush_nbx)(void *, const void *);
static ucs_status_t (*p_mem_map)(void *, const void *, void **);
static ucs_status_t (*p_mem_unmap)(void *, void *);
static ucs_status_t (*p_rkey_pack)(void *, void *, void **, size_t *);
static void (*p_rkey_buffer_release)(void *);
static ucs_status_t (*p_ep_rkey_unpack)(void *, const void *, void **);
static void (*p_rkey_destroy)(void *);
static void *(*p_put_nbx)(void *, const void *, size_t, uint64_t, void *, const void *);
static ucs_status_t (*p_request_check_status)(void *);
static void (*p_request_free)(void *);
static const char *(*p_status_string)(ucs_status_t);

#define SYM(var, name) do { *(void **)(&var) = dlsym(vhi_ucp, name); if (var == NULL) return 2; } while (0)

// vhi_ucx_open loads libucp once: 0 ok, 1 not found, 2 an entry point missing.
static int vhi_ucx_open(void) {
	if (vhi_ucp != NULL) return 0;
	vhi_ucp = dlopen("libucp.so.0", RTLD_NOW | RTLD_LOCAL);
	if (vhi_ucp == NULL) return 1;
	SYM(p_config_read, "ucp_config_read");
	SYM(p_config_release, "ucp_config_release");
	SYM(p_init_version, "ucp_init_version");
	SYM(p_cleanup, "ucp_cleanup");
	SYM(p_context_print_info, "ucp_context_print_info");
	SYM(p_version_string, "ucp_get_version_string");
	SYM(p_worker_create, "ucp_worker_create");
	SYM(p_worker_destroy, "ucp_worker_destroy");
	SYM(p_worker_get_address, "ucp_worker_get_address");
	SYM(p_worker_release_address, "ucp_worker_release_address");
	SYM(p_worker_progress, "ucp_worker_progress");
	SYM(p_ep_create, "ucp_ep_create");
	SYM(p_ep_close_nbx, "ucp_ep_close_nbx");
	SYM(p_ep_flush_nbx, "ucp_ep_flush_nbx");
	SYM(p_mem_map, "ucp_mem_map");
	SYM(p_mem_unmap, "ucp_mem_unmap");
	SYM(p_rkey_pack, "ucp_rkey_pack");
	SYM(p_rkey_buffer_release, "ucp_rkey_buffer_release");
	SYM(p_ep_rkey_unpack, "ucp_ep_rkey_unpack");
	SYM(p_rkey_destroy, "ucp_rkey_destroy");
	SYM(p_put_nbx, "ucp_put_nbx");
	SYM(p_request_check_status, "ucp_request_check_status");
	SYM(p_request_free, "ucp_request_free");
	SYM(p_status_string, "ucs_status_string");
	return 0;
}

static void vhi_ucx_close(void) {
	if (vhi_ucp != NULL) dlclose(vhi_ucp);
	vhi_ucp = NULL;
}

static const char *vhi_status(ucs_status_t s) {
	if (s == VHI_NOT_LOADED) return "libucp is not loaded";
	return vhi_ucp ? p_status_string(s) : "unknown";
}

static const char *vhi_version(void) { return vhi_ucp ? p_version_string() : ""; }

// vhi_init reads the UCX_* environment (UCX_TLS, UCX_NET_DEVICES, ...) and
// creates a context for one-sided RMA.
static ucs_status_t vhi_init(void **ctx) {
	if (!vhi_ucp) return VHI_NOT_LOADED;
	void *cfg = NULL;
	ucs_status_t s = p_config_read(NULL, NULL, &cfg);
	if (s != VHI_UCS_OK) return s;
	vhi_ucp_params p;
	memset(&p, 0, sizeof(p));
	p.field_mask = VHI_UCP_PARAM_FIELD_FEATURES;
	p.features = VHI_UCP_FEATURE_RMA;
	s = p_init_version(VHI_UCP_API_MAJOR, VHI_UCP_API_MINOR, &p, cfg, ctx);
	p_config_release(cfg);
	return s;
}

static void vhi_cleanup(void *ctx) { if (vhi_ucp) p_cleanup(ctx); }

// vhi_info is ucp_context_print_info's text (the caller frees it).
static char *vhi_info(void *ctx) {
	if (!vhi_ucp) return NULL;
	char *buf = NULL;
	size_t n = 0;
	FILE *f = open_memstream(&buf, &n);
	if (f == NULL) return NULL;
	p_context_print_info(ctx, f);
	fclose(f);
	return buf;
}

static ucs_status_t vhi_worker(void *ctx, void **w) {
	if (!vhi_ucp) return VHI_NOT_LOADED;
	vhi_ucp_worker_params p;
	memset(&p, 0, sizeof(p));
	p.field_mask = VHI_UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	p.thread_mode = VHI_UCS_THREAD_MODE_SERIALIZED;
	return p_worker_create(ctx, &p, w);
}

static void vhi_worker_destroy(void *w) { if (vhi_ucp) p_worker_destroy(w); }
static unsigned vhi_progress(void *w) { return vhi_ucp ? p_worker_progress(w) : 0; }

static ucs_status_t vhi_address(void *w, void **addr, size_t *n) {
	return vhi_ucp ? p_worker_get_address(w, addr, n) : VHI_NOT_LOADED;
}
static void vhi_release_address(void *w, void *addr) { if (vhi_ucp) p_worker_release_address(w, addr); }

// vhi_ep_failed records a peer failure in the endpoint's status word.
static void vhi_ep_failed(void *arg, void *ep, ucs_status_t status) { *(volatile int *)arg = status; }

static ucs_status_t vhi_connect(void *w, const void *addr, int *status_word, void **ep) {
	if (!vhi_ucp) return VHI_NOT_LOADED;
	vhi_ucp_ep_params p;
	memset(&p, 0, sizeof(p));
	p.field_mask = VHI_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | VHI_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
		VHI_UCP_EP_PARAM_FIELD_ERR_HANDLER;
	p.address = addr;
	p.err_mode = VHI_UCP_ERR_HANDLING_MODE_PEER;
	p.err_cb = vhi_ep_failed;
	p.err_arg = status_word;
	return p_ep_create(w, &p, ep);
}

static int64_t vhi_now_ns(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

// vhi_wait progresses the worker until the request completes or the
// deadline passes.
static ucs_status_t vhi_wait(void *w, void *req, int64_t deadline) {
	if (req == NULL) return VHI_UCS_OK;
	if (VHI_PTR_IS_ERR(req)) return VHI_PTR_STATUS(req);
	for (;;) {
		p_worker_progress(w);
		ucs_status_t s = p_request_check_status(req);
		if (s != VHI_UCS_INPROGRESS) {
			p_request_free(req);
			return s;
		}
		if (vhi_now_ns() > deadline) {
			// Abandoned: released now, freed by UCX once it completes (a
			// worker must not be destroyed with requests never released).
			p_request_free(req);
			return VHI_UCS_ERR_TIMED_OUT;
		}
	}
}

// vhi_ep_close closes an endpoint: flushed first, or at once (force)
// when the peer failed.
static void vhi_ep_close(void *w, void *ep, int force, int64_t timeout_ns) {
	if (!vhi_ucp) return;
	vhi_ucp_request_param p;
	memset(&p, 0, sizeof(p));
	if (force) {
		p.op_attr_mask = VHI_UCP_OP_ATTR_FIELD_FLAGS;
		p.flags = VHI_UCP_EP_CLOSE_FLAG_FORCE;
	}
	vhi_wait(w, p_ep_close_nbx(ep, &p), vhi_now_ns() + timeout_ns);
}

// vhi_put_flush puts n spans of local memory to remote addresses under
// one remote key and waits until the endpoint's flush says they all
// landed at the target (or the endpoint failed, or the deadline passed).
static ucs_status_t vhi_put_flush(void *w, void *ep, void *rkey, int n, const uint64_t *local, const uint64_t *len,
		const uint64_t *remote, int64_t timeout_ns) {
	if (!vhi_ucp) return VHI_NOT_LOADED;
	int64_t deadline = vhi_now_ns() + timeout_ns;
	vhi_ucp_request_param p;
	memset(&p, 0, sizeof(p));
	for (int i = 0; i < n; i++) {
		void *r = p_put_nbx(ep, (const void *)(uintptr_t)local[i], len[i], remote[i], rkey, &p);
		if (VHI_PTR_IS_ERR(r)) return VHI_PTR_STATUS(r);
		// Released now, completed by the worker; the flush below waits for it.
		if (VHI_PTR_IS_PTR(r)) p_request_free(r);
		if ((i & 63) == 63) p_worker_progress(w);
	}
	return vhi_wait(w, p_ep_flush_nbx(ep, &p), deadline);
}

static ucs_status_t vhi_mem_map(void *ctx, void *addr, size_t n, void **memh) {
	if (!vhi_ucp) return VHI_NOT_LOADED;
	vhi_ucp_mem_map_params p;
	memset(&p, 0, sizeof(p));
	p.field_mask = VHI_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | VHI_UCP_MEM_MAP_PARAM_FIELD_LENGTH;
	p.address = addr;
	p.length = n;
	return p_mem_map(ctx, &p, memh);
}

// vhi_layout reports the mirrors' offsets and constants, for the test
// that compares them with UCX's headers.
static void vhi_layout(uint64_t *o) {
	o[0] = offsetof(vhi_ucp_params, features);
	o[1] = offsetof(vhi_ucp_worker_params, thread_mode);
	o[2] = offsetof(vhi_ucp_ep_params, address);
	o[3] = offsetof(vhi_ucp_ep_params, err_mode);
	o[4] = offsetof(vhi_ucp_ep_params, err_cb);
	o[5] = offsetof(vhi_ucp_ep_params, err_arg);
	o[6] = offsetof(vhi_ucp_mem_map_params, address);
	o[7] = offsetof(vhi_ucp_mem_map_params, length);
	o[8] = offsetof(vhi_ucp_request_param, flags);
	o[9] = VHI_UCP_PARAM_FIELD_FEATURES;
	o[10] = VHI_UCP_FEATURE_RMA;
	o[11] = VHI_UCP_WORKER_PARAM_FIELD_THREAD_MODE;
	o[12] = VHI_UCS_THREAD_MODE_SERIALIZED;
	o[13] = VHI_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | VHI_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE << 8 | VHI_UCP_EP_PARAM_FIELD_ERR_HANDLER << 16;
	o[14] = VHI_UCP_ERR_HANDLING_MODE_PEER;
	o[15] = VHI_UCP_MEM_MAP_PARAM_FIELD_ADDRESS | VHI_UCP_MEM_MAP_PARAM_FIELD_LENGTH << 8;
	o[16] = VHI_UCP_OP_ATTR_FIELD_FLAGS;
	o[17] = VHI_UCP_EP_CLOSE_FLAG_FORCE;
	o[18] = (uint64_t)(int64_t)VHI_UCS_ERR_TIMED_OUT;
	o[19] = (uint64_t)(int64_t)VHI_UCS_ERR_LAST;
}

static void vhi_mem_unmap(void *ctx, void *memh) { if (vhi_ucp) p_mem_unmap(ctx, memh); }

static ucs_status_t vhi_rkey_pack(void *ctx, void *memh, void **buf, size_t *n) {
	return vhi_ucp ? p_rkey_pack(ctx, memh, buf, n) : VHI_NOT_LOADED;
}
static void vhi_rkey_buffer_release(void *buf) { if (vhi_ucp) p_rkey_buffer_release(buf); }
static ucs_status_t vhi_rkey_unpack(void *ep, const void *buf, void **rkey) {
	return vhi_ucp ? p_ep_rkey_unpack(ep, buf, rkey) : VHI_NOT_LOADED;
}
static void vhi_rkey_destroy(void *rkey) { if (vhi_ucp) p_rkey_destroy(rkey); }
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"time"
	"unsafe"
)

// ErrUnavailable is returned where there is no UCX library to load.
var ErrUnavailable = errors.New("rdma: unavailable: libucp not found (install UCX: Debian's libucx0, or a CUDA-enabled UCX for GPUDirect)")

// ErrNotLoaded is returned by a handle used after its library was closed.
var ErrNotLoaded = errors.New("rdma: libucp is not loaded")

// Error is a UCX status other than UCS_OK.
type Error struct {
	Op     string
	Status int
	Text   string
}

func (e *Error) Error() string {
	return fmt.Sprintf("rdma: %s: %s (UCX status %d)", e.Op, e.Text, e.Status)
}

// The C library handle is process-wide, so is its reference count.
var lib struct {
	mu   sync.Mutex
	refs int
}

// Lib is a reference to the loaded libucp.
type Lib struct {
	mu     sync.Mutex
	closed bool
}

// ucxDefaults are UCX settings vllm-hi needs unless the operator set
// them: UCX's own handlers for SIGSEGV and friends would replace the Go
// runtime's (which turns a nil dereference into a panic).
var ucxDefaults = map[string]string{"UCX_HANDLE_ERRORS": "none", "UCX_ERROR_SIGNALS": ""}

// Load opens libucp.so.0 (once per process). It returns ErrUnavailable
// where UCX is not installed.
func Load() (*Lib, error) {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	if lib.refs == 0 {
		for k, v := range ucxDefaults {
			if _, set := os.LookupEnv(k); !set {
				_ = os.Setenv(k, v)
			}
		}
		switch C.vhi_ucx_open() {
		case 0:
		case 1:
			return nil, ErrUnavailable
		default:
			C.vhi_ucx_close()
			return nil, errors.New("rdma: libucp.so.0 lacks a UCP entry point vllm-hi needs (UCX older than 1.13?)")
		}
	}
	lib.refs++
	return &Lib{}, nil
}

// Close drops this reference; the library is unloaded with the last one.
func (l *Lib) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return nil
	}
	l.closed = true
	lib.mu.Lock()
	defer lib.mu.Unlock()
	lib.refs--
	if lib.refs == 0 {
		C.vhi_ucx_close()
	}
	return nil
}

// Version is the loaded UCX's version string.
func (l *Lib) Version() string { return C.GoString(C.vhi_version()) }

func check(op string, s C.ucs_status_t) error {
	switch {
	case s == C.VHI_UCS_OK:
		return nil
	case s == C.VHI_NOT_LOADED:
		return ErrNotLoaded
	}
	return &Error{Op: op, Status: int(s), Text: C.GoString(C.vhi_status(s))}
}

// Context is a UCP context for one-sided RMA, configured from the UCX_*
// environment (UCX_TLS, UCX_NET_DEVICES, ...).
type Context struct {
	lib *Lib
	h   unsafe.Pointer
}

// NewContext creates a context.
func (l *Lib) NewContext() (*Context, error) {
	var h unsafe.Pointer
	if err := check("ucp_init", C.vhi_init(&h)); err != nil {
		return nil, err
	}
	return &Context{lib: l, h: h}, nil
}

// Close releases the context (after its workers and registrations).
func (c *Context) Close() {
	if c.h != nil {
		C.vhi_cleanup(c.h)
		c.h = nil
	}
}

// Info is UCX's description of the context: its memory domains and
// transports.
func (c *Context) Info() string {
	p := C.vhi_info(c.h)
	if p == nil {
		return ""
	}
	defer C.free(unsafe.Pointer(p))
	return C.GoString(p)
}

// Registration is memory registered with the context, which remote peers
// write to through its packed key.
type Registration struct {
	ctx  *Context
	memh unsafe.Pointer
	Base uintptr
	Len  int
	Key  []byte
}

// Register registers n bytes at p (memory that stays mapped until the
// registration is closed) and packs its remote key.
func (c *Context) Register(p unsafe.Pointer, n int) (*Registration, error) {
	var memh unsafe.Pointer
	if err := check("ucp_mem_map", C.vhi_mem_map(c.h, p, C.size_t(n), &memh)); err != nil {
		return nil, err
	}
	var buf unsafe.Pointer
	var size C.size_t
	if err := check("ucp_rkey_pack", C.vhi_rkey_pack(c.h, memh, &buf, &size)); err != nil {
		C.vhi_mem_unmap(c.h, memh)
		return nil, err
	}
	key := C.GoBytes(buf, C.int(size))
	C.vhi_rkey_buffer_release(buf)
	return &Registration{ctx: c, memh: memh, Base: uintptr(p), Len: n, Key: key}, nil
}

// Close unregisters the memory: keys packed from it stop working.
func (r *Registration) Close() {
	if r.memh != nil {
		C.vhi_mem_unmap(r.ctx.h, r.memh)
		r.memh = nil
	}
}

// Worker is a UCP worker. It is not safe for concurrent use: vllm-hi
// gives every data connection its own.
type Worker struct {
	h unsafe.Pointer
}

// NewWorker creates a worker on the context.
func (c *Context) NewWorker() (*Worker, error) {
	var h unsafe.Pointer
	if err := check("ucp_worker_create", C.vhi_worker(c.h, &h)); err != nil {
		return nil, err
	}
	return &Worker{h: h}, nil
}

// Address is the worker's address, for a peer to connect to.
func (w *Worker) Address() ([]byte, error) {
	var p unsafe.Pointer
	var n C.size_t
	if err := check("ucp_worker_get_address", C.vhi_address(w.h, &p, &n)); err != nil {
		return nil, err
	}
	b := C.GoBytes(p, C.int(n))
	C.vhi_release_address(w.h, p)
	return b, nil
}

// Progress runs the worker's pending communication; it reports whether
// anything happened.
func (w *Worker) Progress() bool { return C.vhi_progress(w.h) > 0 }

// Close destroys the worker (after its endpoints).
func (w *Worker) Close() {
	if w.h != nil {
		C.vhi_worker_destroy(w.h)
		w.h = nil
	}
}

// Endpoint is a connection from a worker to a peer worker.
type Endpoint struct {
	w      *Worker
	h      unsafe.Pointer
	status *C.int // set by UCX when the peer fails (C memory: UCX writes it)
}

// Connect opens an endpoint to the worker at addr, with peer failure
// reporting (a put to a dead target fails rather than hangs).
func (w *Worker) Connect(addr []byte) (*Endpoint, error) {
	if len(addr) == 0 {
		return nil, errors.New("rdma: empty worker address")
	}
	ca := C.CBytes(addr)
	defer C.free(ca)
	status := (*C.int)(C.calloc(1, C.size_t(unsafe.Sizeof(C.int(0)))))
	var h unsafe.Pointer
	if err := check("ucp_ep_create", C.vhi_connect(w.h, ca, status, &h)); err != nil {
		C.free(unsafe.Pointer(status))
		return nil, err
	}
	return &Endpoint{w: w, h: h, status: status}, nil
}

// Failed reports the peer failure UCX saw on the endpoint, if any.
func (e *Endpoint) Failed() error {
	if s := C.ucs_status_t(*e.status); s != 0 {
		return check("endpoint", s)
	}
	return nil
}

// RemoteKey is a peer's packed key unpacked on an endpoint.
type RemoteKey struct{ h unsafe.Pointer }

// Unpack unpacks a key the peer packed.
func (e *Endpoint) Unpack(key []byte) (*RemoteKey, error) {
	if len(key) == 0 {
		return nil, errors.New("rdma: empty remote key")
	}
	ck := C.CBytes(key)
	defer C.free(ck)
	var h unsafe.Pointer
	if err := check("ucp_ep_rkey_unpack", C.vhi_rkey_unpack(e.h, ck, &h)); err != nil {
		return nil, err
	}
	return &RemoteKey{h: h}, nil
}

// Close destroys the unpacked key.
func (k *RemoteKey) Close() {
	if k.h != nil {
		C.vhi_rkey_destroy(k.h)
		k.h = nil
	}
}

// Put is one span of local memory written to a remote address.
type Put struct {
	Local  unsafe.Pointer // C or mapped memory: UCX reads it after Go's call returns to it
	Len    int
	Remote uint64
}

// PutFlush writes the spans through key and returns once the target
// holds them all (the endpoint's flush completed), the endpoint failed,
// or timeout passed.
func (e *Endpoint) PutFlush(key *RemoteKey, puts []Put, timeout time.Duration) error {
	if len(puts) == 0 {
		return nil
	}
	local := make([]C.uint64_t, len(puts))
	lens := make([]C.uint64_t, len(puts))
	remote := make([]C.uint64_t, len(puts))
	for i, p := range puts {
		local[i], lens[i], remote[i] = C.uint64_t(uintptr(p.Local)), C.uint64_t(p.Len), C.uint64_t(p.Remote)
	}
	err := check("put", C.vhi_put_flush(e.w.h, e.h, key.h, C.int(len(puts)), &local[0], &lens[0], &remote[0], C.int64_t(timeout)))
	if f := e.Failed(); f != nil && err != nil {
		return fmt.Errorf("%w (the target failed: %v)", err, f)
	}
	return err
}

// Close closes the endpoint at once (UCX's force close): every put on it
// was flushed or has failed by then, and a graceful close would wait on
// a peer that may already have moved on.
func (e *Endpoint) Close() {
	if e.h == nil {
		return
	}
	C.vhi_ep_close(e.w.h, e.h, 1, C.int64_t(2*time.Second))
	e.h = nil
	C.free(unsafe.Pointer(e.status))
}

// CAlloc is n zeroed bytes of C memory: buffers UCX reads or writes after
// a call returns (staging, bounce buffers) must not be Go memory, which
// the Go runtime may move or reuse. Free it with CFree.
func CAlloc(n int) []byte {
	p := C.calloc(C.size_t(n), 1)
	if p == nil {
		return nil
	}
	return unsafe.Slice((*byte)(p), n)
}

// CFree frees memory from CAlloc.
func CFree(b []byte) {
	if len(b) > 0 {
		C.free(unsafe.Pointer(&b[0]))
	}
}

// layout is vhi_layout's answer (see TestStructLayoutMatchesHeaders).
func layout() []uint64 {
	o := make([]C.uint64_t, 20)
	C.vhi_layout(&o[0])
	out := make([]uint64, len(o))
	for i, v := range o {
		out[i] = uint64(v)
	}
	return out
}

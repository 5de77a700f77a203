"""How a worker's KV buffer is described to an agent: where each layer
goes in one buffer, the region's strides from a layer's view, and the CUDA
IPC export of GPU memory. Plain values in, plain values out (no torch, no
vLLM), so the unit tests run anywhere; worker.py feeds it the tensors.
"""

from __future__ import annotations

import base64
import ctypes
import os
import socket


def layer_slices(kv_cache_tensors, layer_index) -> tuple[int, list[tuple[int, int, list[str]]]]:
    """Where each of 0.26's per-layer KV tensors goes in one buffer: the
    buffer's size and (offset, size, layer names) per tensor, in layer
    order. Cross-layer packed tensors (block_stride > 0) alias one backing
    already: they all start at 0."""
    if any(getattr(t, "block_stride", 0) > 0 for t in kv_cache_tensors):
        sizes = {t.size for t in kv_cache_tensors}
        if len(sizes) != 1:
            raise RuntimeError(f"vllm-hi: packed KV tensors of different sizes {sorted(sizes)}")
        size = sizes.pop()
        return size, [(0, size, list(t.shared_by)) for t in kv_cache_tensors]
    ordered = sorted(kv_cache_tensors, key=lambda t: min(layer_index(n) for n in t.shared_by))
    out, at = [], 0
    for t in ordered:
        out.append((at, t.size, list(t.shared_by)))
        at += t.size
    return at, out


def view_strides(shape, strides, elem: int, head_dim: int, heads: int, on_cpu: bool) -> dict:
    """The region's strides (bytes) from one layer's KV view, with the
    view's block count and slots per block ("_num_blocks", "_block_size").

    Known views: 4-D [blocks, ·, ·, 2*head_dim] — K and V side by side in
    the last dimension (K = [..., :head_dim], V = [..., head_dim:]) — and
    5-D views with a K/V dimension of 2 first or second, then the blocks,
    then slots and heads. Which middle dimension holds the heads and which
    the slots is read from their sizes; when the two sizes are equal the
    attention backends' own order decides: heads before slots in the 4-D
    view, slots before heads in the 5-D ones (vLLM's
    get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))."""
    shape, st = tuple(shape), [x * elem for x in strides]
    if len(shape) == 4 and shape[3] == 2 * head_dim:
        h, n = _heads_and_slots(shape, 1, 2, heads, heads_first=True)
        sizes = {"_num_blocks": shape[0], "_block_size": shape[n]}
        if on_cpu:
            # vLLM CPU (LBHNC): its kernels tile K and V inside a block, so
            # single slots are not addressable whatever the view's strides
            # say. Each layer's block is one contiguous range; describe it
            # as packed (kv, head, slot) so whole-block copies between
            # same-shaped engines move the right bytes, and mark the blocks
            # opaque so no one copies single slots.
            blk = st[0]
            return {"block_stride": blk, "kv_stride": blk // 2, "head_stride": blk // (2 * heads),
                    "slot_stride": head_dim * elem, "_opaque": True, **sizes}
        return {"block_stride": st[0], "head_stride": st[h], "slot_stride": st[n], "kv_stride": head_dim * elem,
                **sizes}
    if len(shape) == 5 and shape[4] == head_dim and 2 in shape[:2]:
        kv, blk = (0, 1) if shape[0] == 2 else (1, 0)
        h, n = _heads_and_slots(shape, 2, 3, heads, heads_first=False)
        return {"kv_stride": st[kv], "block_stride": st[blk], "head_stride": st[h], "slot_stride": st[n],
                "_num_blocks": shape[blk], "_block_size": shape[n]}
    raise RuntimeError(f"vllm-hi: unsupported KV view shape {shape}")


def _heads_and_slots(shape, a: int, b: int, heads: int, heads_first: bool) -> tuple[int, int]:
    """Which of dimensions a and b holds the heads and which the slots."""
    if shape[a] == shape[b]:
        if shape[a] != heads:
            raise RuntimeError(f"vllm-hi: KV view {shape} has no dimension of {heads} heads")
        return (a, b) if heads_first else (b, a)
    if shape[a] == heads:
        return a, b
    if shape[b] == heads:
        return b, a
    raise RuntimeError(f"vllm-hi: KV view {shape} has no dimension of {heads} heads")


def layer_stride(offsets) -> int:
    """The one distance between consecutive layers' KV (bytes), from each
    layer's byte offset in the buffer, in layer order. Layers that are not
    evenly spaced cannot be one region: refuse rather than describe other
    bytes than the engine uses."""
    if len(offsets) < 2:
        return 0
    step = offsets[1] - offsets[0]
    for i, off in enumerate(offsets):
        if off != offsets[0] + i * step:
            raise RuntimeError(f"vllm-hi: layer {i}'s KV is at byte {off}, not {offsets[0] + i * step}: "
                               "the layers are not evenly spaced in one buffer")
    if step <= 0:
        raise RuntimeError(f"vllm-hi: the layers' KV overlap (stride {step})")
    return step


class CudaError(RuntimeError):
    pass


def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    lib.cuIpcGetMemHandle.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _cuda_call(lib, rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(rc, ctypes.byref(name))
        raise CudaError(f"vllm-hi: {what}: {(name.value or b'CUDA error %d' % rc).decode()}")


def cuda_ipc_memory(ptr: int, device: int, lib=None) -> dict:
    """The layout's memory entry for device memory at ptr: the CUDA IPC
    handle of the allocation that holds it and ptr's offset into it (CUDA
    IPC shares whole allocations; an agent adds the offset). lib is the
    driver (libcuda through ctypes); tests pass a fake one."""
    lib = lib or _libcuda()
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _cuda_call(lib, lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)),
               "finding the KV's allocation")
    handle = ctypes.create_string_buffer(64)
    _cuda_call(lib, lib.cuIpcGetMemHandle(handle, base.value),
               "exporting the KV through CUDA IPC (memory from cuMemCreate, e.g. vLLM's sleep-mode pool, "
               "cannot be shared this way)")
    mem = {"kind": "cuda_ipc", "device": device, "ipc_handle": base64.b64encode(handle.raw).decode(),
           "offset": ptr - base.value, "pid": os.getpid(), "node": socket.gethostname(),
           "device_pointer": base.value}
    uuid = device_uuid(device, lib)
    if uuid:
        mem["device_uuid"] = uuid
    return mem


def device_uuid(device: int, lib) -> str | None:
    """The GPU's UUID as NVML and nvidia-smi print it ("GPU-…"), or None
    where the driver cannot say. The ordinal is this process's (vLLM's
    workers run under CUDA_VISIBLE_DEVICES, so GPU 1 may be their 0); the
    agent finds the GPU by its UUID in its own numbering."""
    dev = ctypes.c_int()
    if lib.cuDeviceGet(ctypes.byref(dev), device) != 0:
        return None
    get = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    raw = ctypes.create_string_buffer(16)
    if get is None or get(raw, dev) != 0:
        return None
    h = raw.raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

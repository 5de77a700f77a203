"""The KV description (kvdesc.py) without torch, vLLM or a GPU: layer
placement, strides from each known view, and the CUDA IPC export against
a fake driver."""

import base64
import ctypes
import os
import sys
import unittest
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin.kvdesc import CudaError, cuda_ipc_memory, layer_slices, layer_stride, view_strides  # noqa: E402


def layer_index(name):
    return int(name.split(".")[2])


class LayerSlicesTest(unittest.TestCase):
    def test_layers_end_to_end_in_layer_order(self):
        # vLLM lists the tensors in any order; the buffer holds them by layer.
        ts = [SimpleNamespace(size=100, shared_by=[f"model.layers.{i}.attn"], block_stride=0) for i in (2, 0, 1)]
        total, slices = layer_slices(ts, layer_index)
        self.assertEqual(total, 300)
        self.assertEqual(slices, [(0, 100, ["model.layers.0.attn"]), (100, 100, ["model.layers.1.attn"]),
                                  (200, 100, ["model.layers.2.attn"])])

    def test_packed_tensors_share_one_backing(self):
        ts = [SimpleNamespace(size=500, shared_by=[f"model.layers.{i}.attn"], block_stride=64) for i in range(3)]
        total, slices = layer_slices(ts, layer_index)
        self.assertEqual(total, 500)
        self.assertTrue(all(at == 0 and size == 500 for at, size, _ in slices))
        ts[1].size = 400
        with self.assertRaises(RuntimeError):
            layer_slices(ts, layer_index)


class StridesTest(unittest.TestCase):
    def test_gpu_packed_kv_in_the_last_dimension(self):
        # FlashAttention, NHD: logical (B, H, N, 2D) over physical (B, N, H, 2D),
        # bf16, 8 heads, 16 slots, head_dim 128.
        B, H, N, D = 10, 8, 16, 128
        strides = (N * H * 2 * D, 2 * D, H * 2 * D, 1)
        got = view_strides((B, H, N, 2 * D), strides, 2, D, H, on_cpu=False)
        self.assertEqual(got, {"block_stride": N * H * 2 * D * 2, "head_stride": 2 * D * 2,
                               "slot_stride": H * 2 * D * 2, "kv_stride": D * 2,
                               "_num_blocks": B, "_block_size": N})
        self.assertNotIn("_opaque", got)

    def test_cpu_blocks_are_opaque(self):
        B, H, N, D = 10, 2, 16, 64
        strides = (H * N * 2 * D, N * 2 * D, 2 * D, 1)
        got = view_strides((B, H, N, 2 * D), strides, 2, D, H, on_cpu=True)
        blk = H * N * 2 * D * 2
        self.assertEqual(got, {"block_stride": blk, "kv_stride": blk // 2, "head_stride": blk // (2 * H),
                               "slot_stride": D * 2, "_opaque": True, "_num_blocks": B, "_block_size": N})

    def test_five_dimensional_views(self):
        B, H, N, D = 4, 2, 16, 64
        kv_first = view_strides((2, B, H, N, D), (B * H * N * D, H * N * D, N * D, D, 1), 2, D, H, on_cpu=False)
        self.assertEqual(kv_first["kv_stride"], B * H * N * D * 2)
        self.assertEqual(kv_first["slot_stride"], D * 2)
        self.assertEqual((kv_first["_num_blocks"], kv_first["_block_size"]), (B, N))
        blocks_first = view_strides((B, 2, H, N, D), (2 * H * N * D, H * N * D, N * D, D, 1), 2, D, H, on_cpu=False)
        self.assertEqual(blocks_first["block_stride"], 2 * H * N * D * 2)
        self.assertEqual(blocks_first["kv_stride"], H * N * D * 2)
        with self.assertRaises(RuntimeError):
            view_strides((B, H, N, D), (H * N * D, N * D, D, 1), 2, D, H, on_cpu=False)

    def test_flash_attention_slots_before_heads(self):
        # vLLM's FlashAttention: (2, num_blocks, block_size, num_kv_heads, head_size),
        # contiguous (NHD): a slot is H*D elements, a head D.
        B, N, H, D = 6, 16, 8, 128
        got = view_strides((2, B, N, H, D), (B * N * H * D, N * H * D, H * D, D, 1), 2, D, H, on_cpu=False)
        self.assertEqual(got, {"kv_stride": B * N * H * D * 2, "block_stride": N * H * D * 2,
                               "head_stride": D * 2, "slot_stride": H * D * 2, "_num_blocks": B, "_block_size": N})
        # The same with HND strides (heads outermost inside a block).
        got = view_strides((2, B, N, H, D), (B * N * H * D, N * H * D, D, N * D, 1), 2, D, H, on_cpu=False)
        self.assertEqual((got["head_stride"], got["slot_stride"]), (N * D * 2, D * 2))

    def test_equal_heads_and_slots_follow_the_backend_order(self):
        B, N, D = 3, 16, 64
        H = N
        five = view_strides((2, B, N, H, D), (B * N * H * D, N * H * D, H * D, D, 1), 2, D, H, on_cpu=False)
        self.assertEqual((five["slot_stride"], five["head_stride"]), (H * D * 2, D * 2))
        four = view_strides((B, H, N, 2 * D), (H * N * 2 * D, N * 2 * D, 2 * D, 1), 2, D, H, on_cpu=False)
        self.assertEqual((four["head_stride"], four["slot_stride"]), (N * 2 * D * 2, 2 * D * 2))
        with self.assertRaises(RuntimeError):
            view_strides((2, B, 4, 4, D), (B * 16 * D, 16 * D, 4 * D, D, 1), 2, D, 8, on_cpu=False)

    def test_layer_stride_needs_even_spacing(self):
        self.assertEqual(layer_stride([0]), 0)
        self.assertEqual(layer_stride([0, 4096, 8192]), 4096)
        with self.assertRaises(RuntimeError):
            layer_stride([0, 4096, 9000])
        with self.assertRaises(RuntimeError):
            layer_stride([4096, 0])


class FakeDriver:
    """libcuda's three calls, over one allocation [base, base+size)."""

    def __init__(self, base, size, ipc_rc=0, uuid=bytes(range(0xA0, 0xB0))):
        self.base, self.size, self.ipc_rc, self.uuid = base, size, ipc_rc, uuid
        self.exported = None
        if uuid is None:
            self.cuDeviceGetUuid_v2 = None  # a driver without it

    def cuDeviceGet(self, pdev, ordinal):
        pdev._obj.value = ordinal
        return 0

    def cuDeviceGetUuid_v2(self, out, dev):
        ctypes.memmove(out, self.uuid, 16)
        return 0

    def cuMemGetAddressRange_v2(self, pbase, psize, ptr):
        if not self.base <= ptr.value < self.base + self.size:
            return 1  # CUDA_ERROR_INVALID_VALUE
        pbase._obj.value, psize._obj.value = self.base, self.size
        return 0

    def cuIpcGetMemHandle(self, handle, base):
        if self.ipc_rc:
            return self.ipc_rc
        self.exported = base
        ctypes.memmove(handle, bytes(range(64)), 64)
        return 0

    def cuGetErrorName(self, rc, pname):
        pname._obj.value = {1: b"CUDA_ERROR_INVALID_VALUE", 801: b"CUDA_ERROR_NOT_SUPPORTED"}[rc]
        return 0


class CudaIPCTest(unittest.TestCase):
    def test_handle_of_the_allocation_and_offset_into_it(self):
        drv = FakeDriver(base=0x7F0000000000, size=1 << 30)
        mem = cuda_ipc_memory(0x7F0000000000 + 4096, 3, lib=drv)
        self.assertEqual(drv.exported, 0x7F0000000000)  # the base, not the pointer
        self.assertEqual(mem["kind"], "cuda_ipc")
        self.assertEqual(mem["device"], 3)
        self.assertEqual(mem["offset"], 4096)
        self.assertEqual(mem["device_pointer"] + mem["offset"], 0x7F0000000000 + 4096)
        self.assertEqual(base64.b64decode(mem["ipc_handle"]), bytes(range(64)))
        self.assertEqual(mem["pid"], os.getpid())
        self.assertTrue(mem["node"])
        self.assertEqual(mem["device_uuid"], "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf")  # NVML's spelling

    def test_no_uuid_where_the_driver_cannot_say(self):
        mem = cuda_ipc_memory(0x1000, 0, lib=FakeDriver(base=0x1000, size=0x1000, uuid=None))
        self.assertNotIn("device_uuid", mem)  # the agent falls back to the ordinal

    def test_driver_errors_are_named(self):
        with self.assertRaisesRegex(CudaError, "CUDA_ERROR_INVALID_VALUE"):
            cuda_ipc_memory(5, 0, lib=FakeDriver(base=0x1000, size=0x1000))
        with self.assertRaisesRegex(CudaError, "sleep-mode pool.*CUDA_ERROR_NOT_SUPPORTED"):
            cuda_ipc_memory(0x1000, 0, lib=FakeDriver(base=0x1000, size=0x1000, ipc_rc=801))


if __name__ == "__main__":
    unittest.main()

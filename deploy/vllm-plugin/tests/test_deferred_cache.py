"""Installed requests' blocks cached after the commit, a budget a step
(no vLLM needed: a KV cache manager with vLLM's fields, whose caching
records what it was asked). test_core_install_vllm.py runs it against
vLLM's own scheduler and block pool."""

import os
import sys
import unittest
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin.deferred_cache import DeferredCaching  # noqa: E402

BS = 16


class Block:
    def __init__(self, i):
        self.block_id, self.block_hash = i, None


class Manager:
    """vLLM's SingleTypeKVCacheManager's fields that the caching reads."""

    def __init__(self):
        self.block_size = BS
        self.req_to_blocks = defaultdict(list)
        self.num_cached_block = {}

    def cache_blocks(self, req, num_tokens):
        # vLLM's: hashes the blocks from the count it keeps up to num_tokens.
        start, full = self.num_cached_block.get(req, 0), num_tokens // BS
        for i, b in enumerate(self.req_to_blocks[req][start:full], start):
            assert b.block_hash is None, "a second hash of a cached block"
            b.block_hash = (req, i)
        self.num_cached_block[req] = max(start, full)

    def free(self, req):
        self.req_to_blocks.pop(req, None)
        self.num_cached_block.pop(req, None)


class Coordinator:
    def __init__(self, *managers):
        self.single_type_managers = managers

    def cache_blocks(self, req, num_tokens):
        for m in self.single_type_managers:
            m.cache_blocks(req, num_tokens)


class KVM:
    def __init__(self, *managers, caching=True):
        self.coordinator = Coordinator(*managers)
        self.enable_caching = caching


class Clock:
    """Each read advances it: a run's budget lets a known number through."""

    def __init__(self, tick):
        self.t, self.tick = 0.0, tick

    def __call__(self):
        self.t += self.tick
        return self.t


class DeferredCachingTest(unittest.TestCase):
    def setUp(self):
        self.m = Manager()
        # A request is its own id here: the manager's caching takes either.
        for r, n in (("a", 5), ("b", 3), ("c", 4)):
            self.m.req_to_blocks[r] = [Block(i) for i in range(n)]

    def test_the_first_step_skips_them_and_later_steps_cache_each_once(self):
        d = DeferredCaching(KVM(self.m), clock=Clock(0.0004), budget_s=0.001)
        self.assertTrue(d.defer("a", "a", 5 * BS + 3))  # 5 full blocks
        self.assertTrue(d.defer("b", "b", 2 * BS + 15))  # 2 full, the third partial
        self.assertTrue(d.defer("c", "c", 4 * BS))
        # vLLM's first scheduling after the commit caches from the count:
        # nothing below it (one new token's block at most).
        for r in "abc":
            self.m.cache_blocks(r, self.m.num_cached_block[r] * BS + 1)
        self.assertTrue(all(b.block_hash is None for r in "abc" for b in self.m.req_to_blocks[r]))
        self.assertEqual(d.run(), 2)  # the budget lets two through
        self.assertEqual([b.block_hash is not None for b in self.m.req_to_blocks["a"]], [True] * 5)
        self.assertEqual([b.block_hash is not None for b in self.m.req_to_blocks["b"]], [True, True, False])
        self.assertTrue(all(b.block_hash is None for b in self.m.req_to_blocks["c"]))
        self.assertEqual(len(d), 1)
        # A block c completed since is vLLM's to cache, not the deferral's.
        self.m.req_to_blocks["c"].append(Block(4))
        self.m.cache_blocks("c", 5 * BS)
        self.assertIsNone(self.m.req_to_blocks["c"][0].block_hash)
        self.assertEqual(d.run(), 1)
        self.assertEqual([b.block_hash for b in self.m.req_to_blocks["c"]], [("c", i) for i in range(5)])
        self.assertEqual(self.m.num_cached_block["c"], 5)  # vLLM's count kept
        self.assertEqual(d.run(), 0)

    def test_a_shared_prefix_counted_cached_is_left_to_its_holder(self):
        d = DeferredCaching(KVM(self.m), budget_s=1.0)
        self.m.num_cached_block["b"] = 2  # its first two blocks are another request's
        self.assertFalse(d.defer("b", "b", 2 * BS))
        self.assertTrue(d.defer("a", "a", 5 * BS))
        self.m.num_cached_block["c"] = 1
        self.assertTrue(d.defer("c", "c", 4 * BS))
        d.run()
        self.assertIsNone(self.m.req_to_blocks["c"][0].block_hash)
        self.assertEqual([b.block_hash for b in self.m.req_to_blocks["c"][1:]], [("c", i) for i in range(1, 4)])

    def test_a_request_freed_or_preempted_before_its_turn_is_skipped(self):
        d = DeferredCaching(KVM(self.m), budget_s=1.0)
        d.defer("a", "a", 5 * BS)
        d.defer("b", "b", 3 * BS)
        self.m.free("a")  # finished
        self.m.free("b")  # preempted and scheduled again: new blocks, cached by vLLM from 0
        self.m.req_to_blocks["b"] = [Block(i) for i in range(3)]
        self.m.cache_blocks("b", 3 * BS)
        self.assertEqual(d.run(), 2)
        self.assertNotIn("a", self.m.req_to_blocks)
        self.assertEqual(self.m.num_cached_block["b"], 3)

    def test_nothing_deferred_without_the_cache_or_with_several_groups(self):
        self.assertFalse(DeferredCaching(KVM(self.m, caching=False)).defer("a", "a", 5 * BS))
        self.assertFalse(DeferredCaching(KVM(self.m, Manager())).defer("a", "a", 5 * BS))
        self.assertNotIn("a", self.m.num_cached_block)
        self.assertFalse(DeferredCaching(KVM(self.m)).defer("a", "a", BS - 1))  # no full block


if __name__ == "__main__":
    unittest.main()

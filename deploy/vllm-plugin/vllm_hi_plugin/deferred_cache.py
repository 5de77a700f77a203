"""Installed requests' full blocks offered to the prefix cache after the
commit, a little each step, instead of all in the target's first step.

With prefix caching on (vLLM's default) the scheduler hashes every full
block of a request the first time it schedules it: for 256 installed
requests of ~1.1k tokens that is ~18,000 blocks and 20–25 ms of Python in
the target's first step after a migration's commit (bench_core_install.py,
2026-12-06), which the clients wait through before their first token from
the target. Those blocks need no hash to be decoded from; the hash only
lets later requests share them. So the commit marks them as cached for
vLLM (its first step skips them) and this offers them to the cache at the
end of later steps, within a small time budget each: by then the KV they
hold is final and was checked before the commit, which is what a block
must be before other requests may reuse it.

Only for a KV cache of one group (full attention, the common case): a
hybrid model's coordinator aligns what it caches across groups, and its
blocks are left to vLLM's own first step.
"""
from __future__ import annotations

import time
from collections import deque

# What one step may spend on it: at ~1.1 µs a block, ~900 blocks a step,
# so 256 installed requests of ~70 full blocks are cached within ~20 steps.
STEP_BUDGET_S = 0.001


class _Pending:
    __slots__ = ("rid", "req", "blocks", "start", "upto")

    def __init__(self, rid, req, blocks, start, upto):
        self.rid, self.req, self.blocks, self.start, self.upto = rid, req, blocks, start, upto


class DeferredCaching:
    """The installed requests whose full blocks still wait for their hashes
    in the prefix cache, oldest first."""

    def __init__(self, kv_cache_manager, clock=time.perf_counter, budget_s: float = STEP_BUDGET_S):
        self.kvm = kv_cache_manager
        self.clock = clock
        self.budget_s = budget_s
        self.pending: deque[_Pending] = deque()

    def _manager(self):
        coord = getattr(self.kvm, "coordinator", None)
        managers = getattr(coord, "single_type_managers", None) or ()
        if not getattr(self.kvm, "enable_caching", False) or len(managers) != 1:
            return None
        return managers[0]

    def defer(self, rid: str, req, computed: int) -> bool:
        """At the commit of an installed request with computed tokens of KV:
        vLLM's next scheduling of it caches none of its blocks up to there.
        False where nothing was deferred (no prefix caching, a hybrid
        model, no full block beyond those it already counts as cached)."""
        mgr = self._manager()
        if mgr is None:
            return False
        blocks = mgr.req_to_blocks.get(rid)
        start = mgr.num_cached_block.get(rid, 0)  # a shared prefix's blocks count as cached already
        upto = min(computed // mgr.block_size, len(blocks or ()))
        if not blocks or upto <= start:
            return False
        mgr.num_cached_block[rid] = upto
        self.pending.append(_Pending(rid, req, blocks, start, upto))
        return True

    def run(self) -> int:
        """At a step's end: caches the oldest pending requests' blocks until
        the budget is spent; how many requests it finished."""
        if not self.pending:
            return 0
        mgr = self._manager()
        deadline = self.clock() + self.budget_s
        done = 0
        while self.pending and self.clock() < deadline:
            p = self.pending.popleft()
            done += 1
            if mgr is None or mgr.req_to_blocks.get(p.rid) is not p.blocks or p.rid not in mgr.num_cached_block:
                continue  # finished, aborted or preempted since: its blocks went back
            if p.blocks[p.start].block_hash is not None:
                continue  # hashed already (never expected: a second hash is an assertion in vLLM)
            now = mgr.num_cached_block[p.rid]
            # vLLM's own caching of [start, upto), as its first step would
            # have done it: the coordinator hashes from the count it keeps.
            mgr.num_cached_block[p.rid] = p.start
            try:
                self.kvm.coordinator.cache_blocks(p.req, p.upto * mgr.block_size)
            finally:
                mgr.num_cached_block[p.rid] = max(now, p.upto)
        return done

    def __len__(self) -> int:
        return len(self.pending)

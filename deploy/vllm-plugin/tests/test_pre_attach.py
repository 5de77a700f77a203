"""A pre-attach (attach from=-1): the Host opens a moving stream on the
target before the pause; the target answers once the install came, from
where it put the request, and says so when it never came (no vLLM
needed)."""

import asyncio
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hi_plugin import hooks  # noqa: E402
from vllm_hi_plugin.wire import HookError  # noqa: E402


def _hooks():
    return hooks.Hooks(engine_client=None, state=None, args=None)


def _installed(n):
    return hooks.Installed(list(range(n)), "x" * n, list(range(1, n + 1)), queue=None, prompt_len=3, meta={})


class PreAttachTest(unittest.TestCase):
    def test_answers_once_installed_from_where_the_install_put_it(self):
        async def run():
            h = _hooks()
            pending = asyncio.ensure_future(h.attach("cmpl-1", -1, 5000))
            await asyncio.sleep(0.05)
            self.assertFalse(pending.done(), "a pre-attach answered before the install")
            self.assertIn("cmpl-1", h.awaiting)
            h.installed["cmpl-1"] = _installed(7)
            h._wake_pre_attached(["cmpl-1"])
            gen = await asyncio.wait_for(pending, 1)
            self.assertNotIn("cmpl-1", h.awaiting)
            # From index 7: the client already has the 7 moved tokens' text.
            self.assertTrue(hasattr(gen, "__anext__"))
            await gen.aclose()

        asyncio.run(run())

    def test_an_install_that_never_comes_is_a_404_in_time(self):
        async def run():
            h = _hooks()
            with self.assertRaises(HookError) as e:
                await asyncio.wait_for(h.attach("cmpl-2", -1, 50), 2)
            self.assertEqual(e.exception.status, 404)
            self.assertEqual(h.awaiting, {})

        asyncio.run(run())

    def test_a_pre_attach_needs_a_wait(self):
        async def run():
            for wait in (0, 600_001):
                with self.assertRaises(HookError) as e:
                    await _hooks().attach("cmpl-3", -1, wait)
                self.assertEqual((e.exception.status, e.exception.param), (400, "wait_ms"))
            with self.assertRaises(HookError) as e:
                await _hooks().attach("cmpl-3", -2)
            self.assertEqual(e.exception.status, 400)

        asyncio.run(run())


class _Queue:
    """RequestOutputCollector's interface, fed by the test."""

    def __init__(self):
        self.items = asyncio.Queue()

    def get_nowait(self):
        return None if self.items.empty() else self.items.get_nowait()

    async def get(self):
        return await self.items.get()


class _Out:
    def __init__(self, text, finished=False):
        self.finished = finished
        self.outputs = [type("O", (), {"token_ids": [1], "text": text, "finish_reason": "length" if finished else None,
                                       "stop_reason": None})()]


class CutTest(unittest.TestCase):
    def test_a_cut_opens_with_the_text_the_client_lacks_and_ends_the_older_reader(self):
        async def run():
            h = _hooks()
            ids = []
            h.chunk = lambda inst, hid, text, finish, stop, n, token_ids=None: ids.append(token_ids) or f"[{text}]"
            inst = hooks.Installed([5, 6, 7], "abcdef", [2, 4, 6], _Queue(), prompt_len=3,
                                   meta={"include_usage": False})
            h.installed["cmpl-9"] = inst
            first = await h.attach("cmpl-9", 3)  # say a pre-attach the Host then left unused
            reading = asyncio.ensure_future(first.__anext__())
            await asyncio.sleep(0.01)
            self.assertFalse(reading.done(), "the first stream yielded with nothing to send")
            with self.assertRaises(HookError) as e:
                await h.attach("cmpl-9", 3, text_from=7)
            self.assertEqual(e.exception.param, "text_from")
            second = await h.attach("cmpl-9", 1, text_from=2)  # the client has "ab", token 5's event
            await asyncio.sleep(0.01)
            self.assertTrue(reading.cancelled() or reading.done(), "the older reader still waits for outputs")
            self.assertEqual(await second.__anext__(), "[cdef]")
            self.assertEqual(ids[-1], [6, 7], "the lead chunk's tokens are those after the client's")
            await inst.queue.items.put(_Out("g"))
            await inst.queue.items.put(_Out(""))  # a token with no text yet is an event too
            await inst.queue.items.put(_Out("h", finished=True))
            rest = [c async for c in second]
            self.assertEqual(rest, ["[g]", "[]", "[h]", "data: [DONE]\n\n"])

        asyncio.run(run())

    def test_a_pre_attach_held_by_the_host_opens_where_the_install_said(self):
        async def run():
            h = _hooks()
            ids = []
            h.chunk = lambda inst, hid, text, finish, stop, n, token_ids=None: ids.append(token_ids) or f"[{text}]"
            pending = asyncio.ensure_future(h.attach("cmpl-8", -1, 5000))
            await asyncio.sleep(0.01)
            inst = hooks.Installed([5, 6, 7], "abcdef", [2, 4, 6], _Queue(), prompt_len=3,
                                   meta={"include_usage": False})
            inst.text_from = 3  # the Host's relay holds the client at "abc"
            h.installed["cmpl-8"] = inst
            h._wake_pre_attached(["cmpl-8"])
            gen = await asyncio.wait_for(pending, 1)
            self.assertEqual(await gen.__anext__(), "[def]")
            self.assertIsNone(ids[-1], "a pre-attach's lead chunk names tokens it cannot know the client lacks")
            await inst.queue.items.put(_Out("g", finished=True))
            self.assertEqual([c async for c in gen], ["[g]", "data: [DONE]\n\n"])

        asyncio.run(run())


if __name__ == "__main__":
    unittest.main()

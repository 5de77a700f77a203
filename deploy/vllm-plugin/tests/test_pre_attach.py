"""A pre-attach (attach from=-1): the Host opens a moving stream on the
target before the pause; the target answers at once, its stream's body
waits for the install (woken once installs stop coming) and goes on from
where the install put the request; an install that never came ends it with
an error event (no vLLM needed)."""

import asyncio
import json
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
    def test_answers_at_once_and_streams_once_installed(self):
        async def run():
            h = _hooks()
            h.chunk = lambda inst, hid, text, finish, stop, n, token_ids=None: f"[{text}]"
            gen = await asyncio.wait_for(h.attach("cmpl-1", -1, 5000), 1)  # the answer's head goes out now
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.05)
            self.assertFalse(first.done(), "a pre-attach's body began before the install")
            self.assertIn("cmpl-1", h.awaiting)
            inst = hooks.Installed([5, 6, 7], "abcdef", [2, 4, 6], _Queue(), prompt_len=3,
                                   meta={"include_usage": False})
            h.installed["cmpl-1"] = inst
            h._wake_pre_attached(["cmpl-1"])
            await asyncio.sleep(0.05)
            self.assertNotIn("cmpl-1", h.awaiting)
            # From index 3: the client already has the 3 moved tokens' text
            # (no text_from), so nothing goes out before the first output.
            self.assertFalse(first.done(), "a pre-attach sent an event with nothing to send")
            await inst.queue.items.put(_Out("g", finished=True))
            self.assertEqual(await asyncio.wait_for(first, 1), "[g]")
            self.assertEqual([c async for c in gen], ["data: [DONE]\n\n"])

        asyncio.run(run())

    def test_an_install_that_never_comes_ends_the_stream_with_a_404_event_in_time(self):
        async def run():
            h = _hooks()
            gen = await h.attach("cmpl-2", -1, 50)
            events = await asyncio.wait_for(_all(gen), 2)
            self.assertEqual(len(events), 1, events)
            body = json.loads(events[0].removeprefix("data: "))
            self.assertEqual((body["error"]["code"], body["error"]["param"]), (404, "request_id"))
            self.assertEqual(h.awaiting, {})

        asyncio.run(run())

    def test_streams_wake_once_installs_stop_coming(self):
        async def run():
            h = _hooks()
            evs = {r: h.awaiting.setdefault(r, asyncio.Event()) for r in ("a", "b")}
            h._wake_soon(["a"])
            await asyncio.sleep(0.2)
            h._wake_soon(["b"])  # the next chunk's install, before the first one's wake
            await asyncio.sleep(0.2)
            self.assertFalse(evs["a"].is_set(), "a stream woke between two installs")
            await asyncio.sleep(0.6)
            self.assertTrue(evs["a"].is_set() and evs["b"].is_set(), "streams still asleep after the last install")
            self.assertEqual(h.to_wake, [])

        saved = hooks.WAKE_AFTER_S
        hooks.WAKE_AFTER_S = 0.3  # wide margins: the test's sleeps may oversleep on a busy machine
        try:
            asyncio.run(run())
        finally:
            hooks.WAKE_AFTER_S = saved

    def test_overlapping_wakes_each_log_their_own_streams(self):
        h = _hooks()
        for r in ("a", "b", "c"):
            h.awaiting[r] = asyncio.Event()
        with self.assertLogs(hooks.LOG, level="DEBUG") as logs:
            h._wake_pre_attached(["a", "b"])
            h._wake_pre_attached(["c"])  # before a's and b's first events
            h._first_event_out("a")
            h._first_event_out("c")
            h._first_event_out("b")
            h._first_event_out("b")  # a stream's second event: not counted
        woke = [m for m in logs.output if "woke" in m]
        self.assertEqual(len(woke), 2, woke)
        self.assertIn("woke 1 pre-attached streams", woke[0])
        self.assertIn("woke 2 pre-attached streams", woke[1])
        self.assertEqual(h.wake_of, {})

    def test_the_pauses_last_install_wakes_its_streams_at_once(self):
        async def run():
            h = _hooks()
            h.chunk = lambda inst, hid, text, finish, stop, n, token_ids=None: f"[{text}]"
            gens = {r: await h.attach(r, -1, 5000) for r in ("a", "b")}
            firsts = {r: asyncio.ensure_future(g.__anext__()) for r, g in gens.items()}
            await asyncio.sleep(0.01)
            for r in gens:
                inst = hooks.Installed([5, 6], "abcd", [2, 4], _Queue(), prompt_len=3, meta={"include_usage": False})
                inst.text_from = 2
                h.installed[r] = inst
            h._wake_soon(["a", "b"])  # what every install does
            h._wake_now()  # what the last one does besides
            self.assertIsNone(h.wake_timer)
            self.assertEqual(await asyncio.wait_for(asyncio.gather(*firsts.values()), 0.2), ["[cd]", "[cd]"])
            for r, g in gens.items():  # the events sent: the streams go on
                await h.installed[r].queue.items.put(_Out("e", finished=True))
                self.assertEqual([c async for c in g], ["[e]", "data: [DONE]\n\n"])
            self.assertEqual(h.wake_of, {}, "the wake's count of first events did not reach the streams it woke")

        saved = hooks.WAKE_AFTER_S
        hooks.WAKE_AFTER_S = 30  # a debounced wake would not come within the test
        try:
            asyncio.run(run())
        finally:
            hooks.WAKE_AFTER_S = saved

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


async def _all(gen):
    return [c async for c in gen]


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
            gen = await h.attach("cmpl-8", -1, 5000)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.01)
            inst = hooks.Installed([5, 6, 7], "abcdef", [2, 4, 6], _Queue(), prompt_len=3,
                                   meta={"include_usage": False})
            inst.text_from = 3  # the Host's relay holds the client at "abc"
            h.installed["cmpl-8"] = inst
            h._wake_pre_attached(["cmpl-8"])
            self.assertEqual(await asyncio.wait_for(first, 1), "[def]")
            self.assertIsNone(ids[0], "a pre-attach's lead chunk names tokens it cannot know the client lacks")
            await inst.queue.items.put(_Out("g", finished=True))
            self.assertEqual([c async for c in gen], ["[g]", "data: [DONE]\n\n"])

        asyncio.run(run())

    def test_a_held_pre_attach_carries_the_ids_after_those_the_client_got(self):
        """With the install's ids_from (the relay's count of the ids its
        client got at the hold), the lead chunk carries the moved tokens'
        ids after those: every token's id reaches the client once."""
        async def run():
            h = _hooks()
            ids = []
            h.chunk = lambda inst, hid, text, finish, stop, n, token_ids=None: ids.append(token_ids) or f"[{text}]"
            for hid, ids_from, text_from, want_text, want_ids in (
                    ("cmpl-1", 1, 3, "[def]", [6, 7]),  # "abc": token 5 and half of 6's text ("c"), one id
                    ("cmpl-2", 2, 6, "[]", [7]),        # all the text, not token 7's id (its text was empty)
                    ("cmpl-3", 3, 6, None, None)):      # nothing lacking: no lead chunk
                gen = await h.attach(hid, -1, 5000)
                first = asyncio.ensure_future(gen.__anext__())
                await asyncio.sleep(0.01)
                inst = hooks.Installed([5, 6, 7], "abcdef", [2, 4, 6], _Queue(), prompt_len=3,
                                       meta={"include_usage": False})
                inst.text_from, inst.ids_from = text_from, ids_from
                h.installed[hid] = inst
                h._wake_pre_attached([hid])
                if want_text is None:
                    await asyncio.sleep(0.01)
                    self.assertFalse(first.done(), "a lead chunk with nothing the client lacks")
                    await inst.queue.items.put(_Out("g", finished=True))
                    self.assertEqual(await asyncio.wait_for(first, 1), "[g]")
                    continue
                self.assertEqual(await asyncio.wait_for(first, 1), want_text, hid)
                self.assertEqual(ids[-1], want_ids, hid)
                await inst.queue.items.put(_Out("g", finished=True))
                self.assertEqual([c async for c in gen], ["[g]", "data: [DONE]\n\n"])

        asyncio.run(run())


if __name__ == "__main__":
    unittest.main()

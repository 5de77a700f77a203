"""The core channel without vLLM: a fake busy loop drains the boundary."""

import os
import socket
import struct
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_hi_plugin import core_channel  # noqa: E402
from vllm_hi_plugin.core_channel import VERSION, Boundary, ChannelServer, Snapshot, read_frame, write_frame  # noqa: E402
from vllm_hi_plugin.wire import HookError  # noqa: E402


class FakeLoop:
    """A busy loop: steps every step_s, draining the boundary at each
    step's start and end; woken between steps like vLLM's input queue."""

    def __init__(self, boundary: Boundary, step_s: float, idle: bool = False):
        self.b = boundary
        self.step_s = step_s
        self.idle = idle
        self.woken = threading.Event()
        self.stop = threading.Event()
        self.thread_ids = set()  # threads that ran commands
        self.in_step = False
        b = boundary
        b.wake = self.woken.set
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        while not self.stop.is_set():
            if self.idle:
                # vLLM's idle loop blocks on its input queue; a wake-up
                # marker runs the patched handler, which drains.
                if self.woken.wait(0.05):
                    self.woken.clear()
                    self.b.drain()
                continue
            self.b.begin_step()
            self.in_step = True
            time.sleep(self.step_s)  # the forward: no command may run now
            self.in_step = False
            self.b.end_step()

    def close(self):
        self.stop.set()
        self.t.join()


class BoundaryTest(unittest.TestCase):
    def test_commands_run_on_the_loop_thread_between_steps_within_a_step(self):
        b = Boundary()
        loop = FakeLoop(b, step_s=0.02)
        try:
            seen = []

            def cmd():
                seen.append((threading.get_ident(), loop.in_step))
                return 42

            for _ in range(5):
                out, wait_ms, core_ms = b.submit(cmd)
                self.assertEqual(out, 42)
                self.assertLess(wait_ms, 20 * 1.5 + 10)  # within one step (and some scheduling slack)
                self.assertGreaterEqual(core_ms, 0)
            self.assertEqual({t for t, _ in seen}, {loop.t.ident})
            self.assertFalse(any(s for _, s in seen), "a command ran inside a step")
        finally:
            loop.close()

    def test_an_idle_loop_is_woken(self):
        b = Boundary()
        loop = FakeLoop(b, step_s=0, idle=True)
        try:
            t0 = time.perf_counter()
            out, _, _ = b.submit(lambda: "ok")
            self.assertEqual(out, "ok")
            self.assertLess(time.perf_counter() - t0, 0.05)
        finally:
            loop.close()

    def test_work_left_for_after_an_answer_runs_before_the_loop_goes_on(self):
        b = Boundary()
        loop = FakeLoop(b, step_s=0.002)
        order = []
        try:
            def cmd():
                b.later(lambda: order.append("after"))
                order.append("command")
                return "ok"

            b.submit(cmd, lambda fut: order.append("answered"))
            b.submit(lambda: order.append("next command"))
        finally:
            loop.close()
        self.assertEqual(order, ["command", "answered", "after", "next command"])
        # Left by a command that came another way (a utility call): run
        # at the next step's start at the latest.
        b.later(lambda: order.append("at the next step"))
        b.begin_step()
        self.assertEqual(order[-1], "at the next step")

    def test_errors_reach_the_caller(self):
        b = Boundary()
        loop = FakeLoop(b, step_s=0.005)
        try:
            def bad():
                raise HookError(409, "not paused", "request_ids")

            with self.assertRaises(HookError) as cm:
                b.submit(bad)
            self.assertEqual(cm.exception.status, 409)
        finally:
            loop.close()

    def test_no_boundary_in_time_is_a_504_and_the_command_never_runs(self):
        b = Boundary(timeout_s=0.05)  # no loop at all: a wedged engine
        ran = []
        with self.assertRaises(HookError) as cm:
            b.submit(lambda: ran.append(1))
        self.assertEqual(cm.exception.status, 504)
        b.drain()  # the loop comes back later
        self.assertEqual(ran, [])


class Client:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(5)
        self.s.connect(path)
        self.n = 0

    def send(self, msg):
        write_frame(self.s, msg)
        return read_frame(self.s)

    def call(self, op, payload=None):
        self.n += 1
        out = self.send({"id": self.n, "op": op, "payload": payload or {}})
        self.assertEqual_id(out)
        return out

    def assertEqual_id(self, out):
        if out.get("id") != self.n:
            raise AssertionError(f"answer {out} for request {self.n}")

    def close(self):
        self.s.close()


class ServerTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.path = os.path.join(self.dir, "core.sock")
        self.b = Boundary()
        self.loop = FakeLoop(self.b, step_s=0.01)
        self.snap = Snapshot()
        self.snap.publish({"stats": {"num_running": 3}})

        def boom(p):
            raise RuntimeError("a bug")

        def conflict(p):
            raise HookError(409, "Request r is not paused.", "request_ids")

        ops = {"echo": lambda p: {"got": p, "thread": threading.get_ident()}, "boom": boom, "conflict": conflict,
               "big": lambda p: {"blob": "x" * p["n"]}}
        snap_ops = {"stats": lambda p, s: s.get("stats")}
        self.srv = ChannelServer(self.path, "sekret", self.b, ops, snap_ops, self.snap)
        self.srv.start()

    def tearDown(self):
        self.srv.close()
        self.loop.close()

    def hello(self, token="sekret", version=VERSION):
        c = Client(self.path)
        return c, c.send({"op": "hello", "token": token, "version": version})

    def test_the_socket_is_its_owners_and_their_groups_alone(self):
        self.assertEqual(os.stat(self.path).st_mode & 0o777, 0o660)

    def test_hello_checks_the_token_and_the_version(self):
        for token, version, status in (("wrong", VERSION, 401), ("", VERSION, 401), ("sekret", 99, 400)):
            c, out = self.hello(token, version)
            self.assertEqual(out["error"]["status"], status, out)
            self.assertEqual(c.s.recv(1), b"", "the connection stays open after a refused hello")
            c.close()
        c = Client(self.path)
        out = c.send({"id": 1, "op": "echo"})
        self.assertEqual(out["error"]["status"], 400)
        c.close()

    def test_ops_answer_in_order_from_the_loop_or_the_snapshot(self):
        c, out = self.hello()
        self.assertEqual(out["ok"]["version"], VERSION)
        got = c.call("echo", {"x": 1})
        self.assertEqual(got["ok"]["got"], {"x": 1})
        self.assertEqual(got["ok"]["thread"], self.loop.t.ident)
        self.assertIn("wait_ms", got)
        self.assertIn("core_ms", got)
        got = c.call("stats")
        self.assertEqual(got["ok"], {"num_running": 3})
        self.assertEqual(got["wait_ms"], 0.0)
        self.assertEqual(c.call("nope")["error"]["status"], 404)
        self.assertEqual(c.call("conflict")["error"], {"status": 409, "message": "Request r is not paused.", "param": "request_ids"})
        with self.assertLogs("vllm", level="ERROR"):  # an engine-side bug is logged with its traceback
            self.assertEqual(c.call("boom")["error"]["status"], 500)
        self.assertEqual(c.call("echo", {"y": 2})["ok"]["got"], {"y": 2}, "the channel lives on after a failed op")
        c.close()

    def test_an_answer_is_written_by_the_loop_thread_the_moment_it_is_there(self):
        # Handing it to the connection's thread would wait for the GIL
        # while the loop schedules its next step.
        writers = []
        orig = core_channel.frame

        def frame(msg):
            if "ok" in msg or "error" in msg:  # an answer, not the test client's request
                writers.append((msg.get("id"), threading.get_ident()))
            return orig(msg)

        core_channel.frame = frame
        try:
            c, _ = self.hello()
            c.call("echo", {"x": 1})
            c.call("conflict")
            c.call("stats")
        finally:
            core_channel.frame = orig
        self.assertEqual(writers[1:3], [(1, self.loop.t.ident), (2, self.loop.t.ident)], writers)  # [0]: the hello
        self.assertNotEqual(writers[3][1], self.loop.t.ident, "a snapshot op answers from the connection's thread")
        c.close()

    def test_an_answer_larger_than_the_sockets_buffer_arrives_whole_and_in_order(self):
        c, _ = self.hello()
        for n in (8 << 20, 10, 3 << 20):
            got = c.call("big", {"n": n})
            self.assertEqual(len(got["ok"]["blob"]), n)
        self.assertEqual(c.call("echo", {"y": 2})["ok"]["got"], {"y": 2})
        c.close()

    def test_bad_frames_are_refused(self):
        c, _ = self.hello()
        c.s.sendall(struct.pack(">I", 1 << 30))
        out = read_frame(c.s)
        self.assertEqual(out["error"]["status"], 413)
        c.close()
        c, _ = self.hello()
        c.s.sendall(struct.pack(">I", 3) + b"{x}")
        self.assertEqual(read_frame(c.s)["error"]["status"], 400)
        c.close()

    def test_a_stale_socket_is_replaced_and_close_removes_it(self):
        self.srv.close()
        self.assertFalse(os.path.exists(self.path))
        open(self.path, "w").close()  # what a crashed engine leaves
        self.srv = ChannelServer(self.path, "", self.b, {"echo": lambda p: p}, {}, self.snap)
        self.srv.start()
        c, out = self.hello(token="anything")  # no token configured: open
        self.assertIn("ok", out)
        c.close()


if __name__ == "__main__":
    unittest.main()

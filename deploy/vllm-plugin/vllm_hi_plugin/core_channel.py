"""The core channel: the agent's direct line into vLLM's EngineCore process.

The hooks behind `/vllm_hi/engine/*` travel HTTP -> the API server -> an
engine-core utility call, which the busy loop picks up only at the top of
an iteration and answers through the asyncio loop that also serves every
client stream: under load a call whose own work is a millisecond waits
tens of milliseconds (docs/benchmarks.md). The core channel skips the API
server. A server thread in the engine-core process listens on a Unix
socket; the busy-loop thread runs each command at the next step boundary
(an idle loop is woken for it), and questions that need no boundary are
answered from a snapshot the loop publishes after every step.

Wire: each frame is a 4-byte big-endian length and a JSON object. A
connection opens with {"op": "hello", "token": T, "version": 1}, answered
{"ok": {"version": 1, "pid": P, "ops": [...]}} (the ops this engine
takes) or an error and a close. Then each
request {"id": N, "op": OP, "payload": {...}} gets one answer
{"id": N, "ok": ..., "core_ms": C, "wait_ms": W} (C: the command's own
time on the loop thread; W: how long it waited for a step boundary) or
{"id": N, "error": {"status", "message", "param"}}. Requests on one
connection are answered in order; a client opens several connections to
overlap them.

Nothing here imports vLLM: tests/test_core_channel.py runs it alone.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import socket
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from .wire import HookError

LOG = logging.getLogger("vllm.vllm_hi")

VERSION = 1
MAX_FRAME = 64 << 20  # a request's JSON: an install of 256 requests' tokens fits many times over
# How long a command waits for a step boundary before it is answered 504:
# the busy loop reaches one within a step unless the engine is wedged.
BOUNDARY_TIMEOUT_S = 10.0
# A boundary op whose answer took longer than this is logged with where
# its time went (the wait for a boundary, the engine core's own work, the
# answer's encoding): inside a migration's pause every such millisecond is
# the clients' gap.
SLOW_OP_MS = 50.0


class Deferred:
    """A command's answer that must wait for later boundaries: with
    asynchronous scheduling a step is still in flight at every boundary, so
    a pause is done only once the paused requests' last step came back
    (ready). The boundary checks it at each step's start and end."""

    def __init__(self, ready, result):
        self.ready = ready
        self.result = result


class Boundary:
    """Runs commands on the busy-loop thread at a step boundary.

    Every command runs on the loop's own thread, as a utility call does, so
    nothing the scheduler or the executor does runs beside it. The patched
    scheduler drains the queue at the top of schedule() and at the end of
    update_from_output(): with synchronous scheduling nothing is in flight
    at either point. A command submitted between steps (the engine idle, or
    handling its input) wakes the loop through its input queue (wake), and
    the patched input handler drains it there.
    """

    def __init__(self, wake=None, timeout_s: float = BOUNDARY_TIMEOUT_S):
        self.mu = threading.Lock()
        self.pending: deque = deque()
        self.wake = wake  # puts a marker on the loop's input queue
        self.timeout_s = timeout_s
        self.steps = 0
        self.waiting: list = []  # (Deferred, future, t0, t1): run, not yet answered
        self.after: list = []  # work a command left for after its answer (later)
        self.watchers: list = []  # (Deferred, fire): answers another path (a utility call) waits on

    def submit(self, fn, on_done=None):
        """Runs fn at the next boundary; returns (result, wait_ms, core_ms).
        fn's exceptions propagate; a boundary that does not come within
        timeout_s raises HookError 504 (and fn never runs). on_done(future)
        is called on the loop's thread the moment the answer is there (or
        on the caller's, with a cancelled future, when fn never ran)."""
        fut: Future = Future()
        if on_done is not None:
            fut.add_done_callback(on_done)
        with self.mu:
            self.pending.append((fn, fut, time.perf_counter()))
        if self.wake is not None:
            self.wake()
        try:
            return fut.result(self.timeout_s)
        except FutureTimeout:
            if fut.cancel():  # not started: it never will
                raise HookError(504, f"the engine reached no step boundary within {self.timeout_s:.0f} s") from None
            # Started: its answer comes, unless it waits on a step that does
            # not end (a deferred answer past the deadline).
            try:
                return fut.result(self.timeout_s)
            except FutureTimeout:
                raise HookError(504, f"the engine's step in flight did not end within {2 * self.timeout_s:.0f} s") from None

    def later(self, fn) -> None:
        """Runs fn on the loop's thread once the command that asks for it
        is answered, before the loop goes on: work its answer need not
        wait for (a commit's write-log stamps). Called from a command."""
        self.after.append(fn)

    def run_after(self) -> None:
        """Runs what commands left for after their answers."""
        while self.after:
            fns, self.after = self.after, []
            for fn in fns:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - the command was answered; say what failed
                    LOG.exception("vllm_hi: work after a command's answer failed")

    def drain(self) -> None:
        """Runs every pending command (on the loop's thread)."""
        while True:
            with self.mu:
                if not self.pending:
                    return
                fn, fut, t0 = self.pending.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            t1 = time.perf_counter()
            try:
                out = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
                continue
            if isinstance(out, Deferred):
                self.waiting.append((out, fut, t0, t1))
            else:
                fut.set_result((out, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
            self.run_after()
        self.check_waiting()

    def watch(self, d: Deferred, fire) -> None:
        """Calls fire(result, None) or fire(None, exception) once d is ready,
        at a boundary (on the loop's thread)."""
        self.watchers.append((d, fire))

    def _check_watchers(self) -> None:
        still = []
        for d, fire in self.watchers:
            try:
                if not d.ready():
                    still.append((d, fire))
                    continue
                out = d.result()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fire(None, e)
                continue
            fire(out, None)
        self.watchers = still

    def check_waiting(self) -> None:
        """Answers the deferred commands that are ready (on the loop's thread)."""
        if self.watchers:
            self._check_watchers()
        if not self.waiting:
            return
        still = []
        for d, fut, t0, t1 in self.waiting:
            if fut.done():  # its caller gave up
                continue
            try:
                if not d.ready():
                    still.append((d, fut, t0, t1))
                    continue
                out = d.result()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
                continue
            now = time.perf_counter()
            # wait_ms: until the command's effect was complete.
            fut.set_result((out, (now - t0) * 1e3, (now - t1) * 1e3))
        self.waiting = still

    def begin_step(self) -> None:
        if self.pending:
            self.drain()
        self.check_waiting()
        self.run_after()  # left by a command that came another way (a utility call)

    def end_step(self, publish=None) -> None:
        self.steps += 1
        if self.pending:
            self.drain()
        self.check_waiting()
        if publish is not None:
            publish()


class Snapshot:
    """The latest state the loop published: replaced whole, read without a
    lock (a reference swap is atomic)."""

    def __init__(self):
        self.value: dict = {}
        self.at = 0.0

    def publish(self, value: dict) -> None:
        self.value, self.at = value, time.time()


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(conn: socket.socket):
    """One frame's JSON, or None at a clean end of stream."""
    hdr = _read_exact(conn, 4)
    if hdr is None:
        return None
    (n,) = struct.unpack(">I", hdr)
    if n > MAX_FRAME:
        raise HookError(413, f"a frame of {n} bytes is over the limit of {MAX_FRAME}")
    body = _read_exact(conn, n)
    if body is None:
        raise HookError(400, "the connection ended inside a frame")
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise HookError(400, f"a frame is not JSON: {e}") from None
    if not isinstance(msg, dict):
        raise HookError(400, "a frame must be a JSON object")
    return msg


def frame(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return struct.pack(">I", len(body)) + body


def write_frame(conn: socket.socket, msg: dict) -> None:
    conn.sendall(frame(msg))


class _Reply:
    """One request's answer, written once by whichever thread has it first.

    The loop's thread writes it the moment the command is done: handing it
    to the connection's thread instead would wait for the GIL, which the
    loop keeps while it schedules the next step (Python's switch interval,
    5 ms: the pause's answer came ~5 ms after its boundary on the H100).
    The loop never blocks on the socket: what does not fit in the socket's
    buffer (a large export) is left for the connection's thread to send."""

    def __init__(self, conn: socket.socket):
        self.conn = conn
        self.mu = threading.Lock()
        self.claimed = False
        self.rest = b""
        self.written = threading.Event()

    def claim(self) -> bool:
        with self.mu:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def send_from_loop(self, data: bytes) -> None:
        if not self.claim():
            return
        try:
            n = self.conn.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            n = 0
        except OSError:
            n = len(data)  # the connection is gone: its thread ends it
        self.rest = data[n:]
        self.written.set()


def _error(e: HookError, rid=None) -> dict:
    out = {"error": {"status": e.status, "message": e.message, "param": e.param}}
    if rid is not None:
        out["id"] = rid
    return out


class ChannelServer:
    """Serves the core channel on a Unix socket.

    boundary_ops: op -> fn(payload) run at a step boundary, on the
    loop's thread.
    snapshot_ops: op -> fn(payload, snapshot dict) answered at once.
    """

    def __init__(self, path: str, token: str, boundary: Boundary, boundary_ops: dict, snapshot_ops: dict,
                 snapshot: Snapshot):
        self.path = path
        self.token = token
        self.boundary = boundary
        self.boundary_ops = boundary_ops
        self.snapshot_ops = snapshot_ops
        self.snapshot = snapshot
        self.sock: socket.socket | None = None
        self.closed = threading.Event()
        self.conns: set = set()
        self.mu = threading.Lock()

    def start(self) -> None:
        d = os.path.dirname(self.path) or "."
        os.makedirs(d, exist_ok=True)
        try:
            os.unlink(self.path)  # a stale socket of an earlier engine
        except FileNotFoundError:
            pass
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The owner's and its group's (0660): an agent in a sidecar
        # container reaches it through the pod's fsGroup (the directory's
        # setgid group). Nobody else; and a connection still needs the
        # agent token.
        old = os.umask(0o117)
        try:
            s.bind(self.path)
        finally:
            os.umask(old)
        s.listen(64)
        self.sock = s
        threading.Thread(target=self._accept, name="vllm-hi-core-channel", daemon=True).start()
        LOG.info("vllm_hi core channel on %s (%s)", self.path, "token required" if self.token else "no token: open to this machine's users")

    def close(self) -> None:
        self.closed.set()
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        with self.mu:
            conns = list(self.conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.mu:
                self.conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="vllm-hi-core-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if not self._hello(conn):
                return
            while True:
                try:
                    msg = read_frame(conn)
                except HookError as e:
                    write_frame(conn, _error(e))
                    return
                if msg is None:
                    return
                self.serve_one(conn, msg)
        except OSError:
            pass
        finally:
            with self.mu:
                self.conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _hello(self, conn: socket.socket) -> bool:
        try:
            msg = read_frame(conn)
        except HookError as e:
            write_frame(conn, _error(e))
            return False
        if msg is None:
            return False
        if msg.get("op") != "hello":
            write_frame(conn, _error(HookError(400, "a connection opens with a hello")))
            return False
        if msg.get("version") != VERSION:
            write_frame(conn, _error(HookError(400, f"core channel version {msg.get('version')!r}: this engine speaks {VERSION}", "version")))
            return False
        tok = str(msg.get("token") or "")
        if self.token and not hmac.compare_digest(tok.encode(), self.token.encode()):
            write_frame(conn, _error(HookError(401, "the core channel needs the agent's credential", "token")))
            return False
        # ops: what this engine's channel takes, so that an agent uses a
        # newer op only where the plugin has it (same version, more ops).
        ops = sorted(set(self.boundary_ops) | set(self.snapshot_ops))
        write_frame(conn, {"ok": {"version": VERSION, "pid": os.getpid(), "ops": ops}})
        return True

    def serve_one(self, conn: socket.socket, msg: dict) -> None:
        """Answers one request: a boundary op from the loop's thread
        (_Reply), anything else from this one. The next request is read
        only once this answer is out, so answers keep their order."""
        fn = self.boundary_ops.get(msg.get("op"))
        payload = msg.get("payload") or {}
        if fn is None or not isinstance(payload, dict) or msg.get("op") in self.snapshot_ops:
            write_frame(conn, self.handle(msg))
            return
        rid, op, reply = msg.get("id"), msg.get("op"), _Reply(conn)

        def on_done(fut: Future) -> None:
            if fut.cancelled():
                return  # never ran: the connection's thread answers 504
            try:
                out, wait_ms, core_ms = fut.result()
                ans = {"id": rid, "ok": out, "core_ms": core_ms, "wait_ms": wait_ms}
            except BaseException as e:  # noqa: BLE001 - answered, as handle() would
                ans = self._failed(op, e, rid)
            t_enc = time.perf_counter()
            try:
                data = frame(ans)
            except Exception as e:  # noqa: BLE001 - an answer that will not encode
                LOG.exception("vllm_hi core channel op %s: its answer", op)
                data = frame(self._failed(op, e, rid))
            enc_ms = (time.perf_counter() - t_enc) * 1e3
            slow = ans.get("wait_ms", 0.0) + ans.get("core_ms", 0.0) + enc_ms
            if slow >= SLOW_OP_MS:
                LOG.info("vllm_hi core channel op %s took %.1f ms: %.1f ms waiting for a step boundary, %.1f ms "
                         "in the engine core, %.1f ms encoding its answer (%d bytes)",
                         op, slow, ans.get("wait_ms", 0.0), ans.get("core_ms", 0.0), enc_ms, len(data))
            reply.send_from_loop(data)

        try:
            self.boundary.submit(lambda: fn(payload), on_done)
        except BaseException as e:  # noqa: BLE001 - on_done answered it, or nobody did (a timeout)
            if reply.claim():
                write_frame(conn, self._failed(op, e, rid))
                return
        reply.written.wait()
        if reply.rest:
            conn.sendall(reply.rest)

    def _failed(self, op, e: BaseException, rid) -> dict:
        if isinstance(e, HookError):
            return _error(e, rid)
        LOG.error("vllm_hi core channel op %s failed", op, exc_info=e)
        return _error(HookError(500, f"{op}: {type(e).__name__}: {e}"), rid)

    def handle(self, msg: dict) -> dict:
        rid = msg.get("id")
        op = msg.get("op")
        payload = msg.get("payload") or {}
        if not isinstance(payload, dict):
            return _error(HookError(400, "payload must be a JSON object", "payload"), rid)
        try:
            if op in self.snapshot_ops:
                t0 = time.perf_counter()
                out = self.snapshot_ops[op](payload, self.snapshot.value)
                return {"id": rid, "ok": out, "core_ms": (time.perf_counter() - t0) * 1e3, "wait_ms": 0.0}
            fn = self.boundary_ops.get(op)
            if fn is None:
                raise HookError(404, f"unknown core channel op {op!r}", "op")
            out, wait_ms, core_ms = self.boundary.submit(lambda: fn(payload))
            return {"id": rid, "ok": out, "core_ms": core_ms, "wait_ms": wait_ms}
        except HookError as e:
            return _error(e, rid)
        except Exception as e:  # noqa: BLE001 - an engine-side bug answers 500, the channel lives on
            LOG.exception("vllm_hi core channel op %s failed", op)
            return _error(HookError(500, f"{op}: {type(e).__name__}: {e}"), rid)

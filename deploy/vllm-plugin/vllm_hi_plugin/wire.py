"""Pieces of the hook contract that need no vLLM: the IntList encoding,
errors in vLLM's shape, and the write log that gives vLLM write
generations. Unit-tested in tests/test_wire.py without vLLM installed."""

from __future__ import annotations

import base64
import struct
import sys
from array import array
from collections import deque
from dataclasses import dataclass, field


# array's "I" is the C unsigned int: 4 bytes wherever vLLM runs (checked).
_U32 = "I"


def encode_ints(xs) -> str:
    """IntList: base64 of little-endian uint32s (api/hooks/intlist.go).
    Through array, which checks each value's range in C: a Python loop
    over every id was half of an export of 256 requests inside a pause."""
    try:
        a = array(_U32, xs)
    except OverflowError as e:
        raise ValueError(f"IntList: a value does not fit a uint32 ({e})") from None
    if a.itemsize != 4:
        raise ValueError("IntList: this platform has no 4-byte unsigned array type")
    if sys.byteorder != "little":
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode()


def decode_ints(v) -> list[int]:
    """Accepts the base64 form or a plain JSON array."""
    if v is None:
        return []
    if isinstance(v, list):
        return [int(x) for x in v]
    raw = base64.b64decode(v, validate=True)
    if len(raw) % 4:
        raise ValueError("IntList: bad base64 of uint32s")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def ints_after(v, k: int) -> list[int]:
    """The ints of IntList v from index k on, decoding only that tail: an
    install in the pause needs the tokens generated since its stage, not
    the thousand before them."""
    if not isinstance(v, str):
        return decode_ints(v)[k:]
    first = 4 * k // 3 * 3  # the byte where the base64 group holding byte 4k begins
    raw = base64.b64decode(v[first // 3 * 4:], validate=True)[4 * k - first:]
    if len(raw) % 4:
        raise ValueError("IntList: bad base64 of uint32s")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def extends(v, prefix, k: int) -> bool:
    """Whether IntList v begins with prefix, an IntList of k ints, comparing
    their encodings where both are base64 (the groups they share, then the
    up to two bytes of prefix's last group) instead of decoding them."""
    if not isinstance(v, str) or not isinstance(prefix, str):
        return decode_ints(v)[:k] == decode_ints(prefix)
    whole = 4 * k // 3 * 4  # the characters of prefix's complete groups
    if v[:whole] != prefix[:whole]:
        return False
    rest = 4 * k - 4 * k // 3 * 3
    if rest == 0:
        return len(v) >= whole
    try:
        tail = base64.b64decode(v[whole:whole + 4], validate=True)
    except ValueError:
        return False
    return tail[:rest] == base64.b64decode(prefix[whole:])[:rest] and len(tail) >= rest


def tail_reaches(st: dict, n_staged: int) -> bool:
    """Whether st, a state that carries only the output tokens after
    st["output_from"] (an export asked for with output_from), reaches back
    to a stage that holds the first n_staged output tokens: no token in
    between is missing."""
    k = st.get("output_from")
    if not isinstance(k, int) or k < 0 or k > n_staged:
        return False
    return n_staged - k <= len(decode_ints(st["output_token_ids"]))


def tail_after(st: dict, n_staged: int) -> list[int]:
    """The output tokens of st (which tail_reaches n_staged) after the first
    n_staged."""
    return decode_ints(st["output_token_ids"])[n_staged - st["output_from"]:]


def continues(st: dict, prompt, output, n: int) -> bool:
    """Whether st (a request's state in the export's shape) is a state of
    the request an earlier snapshot encoded as prompt and output (n output
    tokens): the same prompt, an output that begins with that one."""
    return st.get("prompt_token_ids") == prompt and extends(st.get("output_token_ids"), output, n)


class HookError(Exception):
    """An error the hook routes answer with vLLM's error shape."""

    TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
             500: "InternalServerError", 503: "ServiceUnavailableError",
             507: "InsufficientStorageError"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


@dataclass
class WriteLog:
    """Write and free generations per KV block, derived from the scheduler.

    vLLM keeps no write generations. Every scheduled step writes exactly the
    slots [num_computed, num_computed + n) of each scheduled request, so the
    plugin stamps those (block, slot) pairs with the step's generation when
    the step is scheduled, and the cursor reaches that generation once the
    step's output was processed: then its writes have landed. A reader that
    sees cursor X therefore saw every stamp <= X, which is what
    `changes?since=X` promises.

    With asynchronous scheduling the next step is scheduled (and stamped)
    before the last one's output is processed, so several steps can be in
    flight: they complete in order, and the cursor follows the oldest. A
    mutation outside a step's writes (a free, an install) takes a fresh
    generation, visible at once when nothing is in flight, else once every
    step scheduled before it has completed (mutation()).
    """

    block_size: int
    cursor: int = 0
    issued: int = 0                                  # the last generation handed out
    inflight: deque = field(default_factory=deque)  # (gen, is_step), oldest first
    block_gen: dict = field(default_factory=dict)   # block -> last write gen
    slot_gen: dict = field(default_factory=dict)    # block -> [gen per slot]
    owner: dict = field(default_factory=dict)       # block -> request id of the last write
    free_gen: dict = field(default_factory=dict)    # block -> gen of its last free
    # The slot generations that whole-block stamps of one generation share.
    _whole: tuple = (0, ())
    # Installs' stamps not applied yet: (request id, block ids, tokens,
    # gen). A commit of 256 moved requests stamps ~18k blocks (5–7 ms on
    # the engine's thread, before its next step); they wait for the next
    # read of the log (changes) instead, where a slot some later stamp
    # wrote keeps the later generation.
    _installed: list = field(default_factory=list)

    @property
    def in_step(self) -> bool:
        """A step is scheduled whose output was not processed yet."""
        return any(is_step for _, is_step in self.inflight)

    def _fresh(self) -> int:
        self.issued = max(self.issued, self.cursor) + 1
        return self.issued

    def begin_step(self) -> int:
        """A step was scheduled: its writes' generation."""
        g = self._fresh()
        self.inflight.append((g, True))
        return g

    def end_step(self) -> None:
        """The oldest step in flight had its output processed."""
        for i, (_, is_step) in enumerate(self.inflight):
            if is_step:
                del self.inflight[i]
                break
        self._settle()

    def _settle(self) -> None:
        # Every generation below the oldest step still in flight has landed
        # (the steps before it completed, and a mutation waits only for the
        # steps scheduled before it).
        steps = [g for g, is_step in self.inflight if is_step]
        bound = steps[0] - 1 if steps else self.issued
        while self.inflight and self.inflight[0][0] <= bound:
            self.inflight.popleft()
        self.cursor = max(self.cursor, bound)

    def mutation(self) -> int:
        """A generation for a change made now outside a step's writes (a free,
        an install): visible once the steps in flight have completed."""
        g = self._fresh()
        if self.in_step:
            self.inflight.append((g, False))
        else:
            self.cursor = g
        return g

    def stamp_tokens(self, request_id: str, block_ids, first_token: int, n: int, gen: int) -> None:
        """Token positions [first_token, first_token + n) of a request whose
        block table is block_ids are written at generation gen."""
        bs = self.block_size
        pos, end = first_token, min(first_token + n, len(block_ids) * bs)
        # Whole blocks in one go: the commit of an install stamps every
        # token of 256 requests (~18k blocks), which one Python step per
        # block made 32 ms of the pause. They share one tuple of
        # generations, copied by the first partial stamp that changes it.
        lo, hi = -(-pos // bs), end // bs
        if hi - lo >= 2 and isinstance(block_ids, (list, tuple)):
            self._stamp_slots(request_id, block_ids, pos, lo * bs, gen)
            whole = block_ids[lo:hi]
            if self._whole[0] != gen:
                self._whole = (gen, (gen,) * bs)
            self.slot_gen.update(dict.fromkeys(whole, self._whole[1]))
            self.block_gen.update(dict.fromkeys(whole, gen))
            self.owner.update(dict.fromkeys(whole, request_id))
            pos = hi * bs
        self._stamp_slots(request_id, block_ids, pos, end, gen)

    def _stamp_slots(self, request_id: str, block_ids, pos: int, end: int, gen: int) -> None:
        bs = self.block_size
        while pos < end:
            i, slot = divmod(pos, bs)
            b = block_ids[i]
            upto = min(end, (i + 1) * bs)
            slots = self.slot_gen.get(b)
            if slots is None:
                slots = self.slot_gen[b] = [0] * bs
            elif isinstance(slots, tuple):  # shared by a whole-block stamp
                slots = self.slot_gen[b] = list(slots)
            slots[slot:upto - (i * bs)] = [gen] * (upto - pos)
            self.block_gen[b] = gen
            self.owner[b] = request_id
            pos = upto

    def stamp_installed(self, request_id: str, block_ids, n: int, gen: int) -> None:
        """Token positions [0, n) of an installed request whose block table
        is block_ids were written at generation gen (an earlier mutation()):
        the same as stamp_tokens(request_id, block_ids, 0, n, gen) as far as
        changes() can tell, applied when it is next called."""
        self._installed.append((request_id, block_ids, n, gen))

    def _apply_installed(self) -> None:
        pending, self._installed = self._installed, []
        bs = self.block_size
        for rid, blocks, n, gen in pending:
            n = min(n, len(blocks) * bs)
            used = blocks[:-(-n // bs)]
            if all(self.block_gen.get(b, 0) < gen for b in used):
                self.stamp_tokens(rid, blocks, 0, n, gen)  # nothing wrote them since
                continue
            for i, b in enumerate(used):
                lo, hi = i * bs, min(n, (i + 1) * bs)
                if self.block_gen.get(b, 0) < gen:
                    self._stamp_slots(rid, blocks, lo, hi, gen)
                    continue
                # Written again since (the request's next tokens, or the
                # block freed and taken by another): each slot keeps the
                # later of the two generations, the block its later writer.
                slots = self.slot_gen.get(b)
                slots = self.slot_gen[b] = list(slots) if slots is not None else [0] * bs
                for k in range(lo - i * bs, hi - i * bs):
                    slots[k] = max(slots[k], gen)

    def stamp_free(self, block_ids) -> None:
        gen = self.mutation()
        for b in block_ids:
            self.free_gen[b] = gen

    def changes(self, since: int, is_free) -> dict:
        if self._installed:
            self._apply_installed()
        written = []
        for b, g in self.block_gen.items():
            if g <= since:
                continue
            slots = self.slot_gen[b]
            hit = [s for s, sg in enumerate(slots) if sg > since]
            written.append({"block": b, "first_slot": hit[0], "num_slots": hit[-1] - hit[0] + 1,
                            "request_id": self.owner.get(b, "")})
        written.sort(key=lambda w: w["block"])
        freed = sorted(b for b, g in self.free_gen.items()
                       if g > since and is_free(b) and self.block_gen.get(b, 0) < g)
        return {"since": since, "cursor": self.cursor, "written": written, "freed": freed}


class Leases:
    """Per-request pause leases: a paused request resumes by itself when
    nobody renews, resumes or exports-and-aborts it in time (the Host may
    die mid-migration)."""

    def __init__(self):
        self.until: dict[str, float] = {}

    def pause(self, ids, now: float, lease_s: float) -> float:
        exp = now + lease_s
        for i in ids:
            self.until[i] = exp
        return exp

    def resume(self, ids=None) -> list[str]:
        if ids is None:
            ids = list(self.until)
        out = [i for i in ids if self.until.pop(i, None) is not None]
        return out

    def expire(self, now: float) -> list[str]:
        gone = [i for i, t in self.until.items() if t <= now]
        for i in gone:
            del self.until[i]
        return gone

    def __contains__(self, rid) -> bool:
        return rid in self.until

    def __len__(self) -> int:
        return len(self.until)


def build_layout(regions: list, vllm_config, engine_version: str, hooks_version: int, served_names: list) -> dict:
    """The layout hook's answer from the workers' regions (worker.
    describe_region) and the engine's config: the same in the API server's
    hook and the core channel's layout op, which differ only in the served
    names they know (the engine core knows the model, not the API
    server's --served-model-name)."""
    geo = dict(regions[0]["_geometry"])
    pc = vllm_config.parallel_config
    mc = vllm_config.model_config
    out_regions = []
    for r in regions:
        r = {k: v for k, v in r.items() if not k.startswith("_")}
        if r["first_layer"] is None or regions[0]["_base_offset"] != 0:
            raise HookError(409, "pipeline parallelism is not supported by the vllm-hi plugin yet")
        out_regions.append(r)
    return {"engine": "vllm", "engine_version": engine_version, "hooks_version": hooks_version,
            "model": mc.model, "served_model_names": served_names, "geometry": geo,
            "parallel": {"tp": pc.tensor_parallel_size,
                         "pp": pc.pipeline_parallel_size},
            "kv_layout": regions[0].get("_kv_layout", ""),
            "opaque_blocks": bool(regions[0].get("_opaque")),
            "stages_state": True,
            "kv_generation": max(int(r.get("_kv_generation") or 0) for r in regions),
            "regions": out_regions}

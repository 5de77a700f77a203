"""A moving request built in the engine core before the pause.

The target's install used to build each moved request inside the pause:
decode its token ids and sampling parameters, make vLLM's Request over a
prompt that holds the source's output too, and hash every full block for
the prefix cache — 20–90 ms for 256 requests of 1k tokens. The stage hook
(before the pause) builds it instead from a snapshot of the request's
state; the install then appends only the tokens generated since (a few
per request), found without decoding the thousand before them.

Only the Request's own lists and counters change here, the ones its
__init__ derives from the prompt; tests/test_core_install_vllm.py checks,
in vLLM 0.26 and 0.32, that a request caught up this way equals one built
over the whole state at once, field by field."""

from __future__ import annotations

from .wire import continues, ints_after, tail_after, tail_reaches


class StagedRequest:
    """vLLM's Request for a moving request, built over a snapshot of its
    state (the export's shape), and brought up to a later state of the same
    request by caught_up."""

    def __init__(self, req, st: dict):
        self.req = req
        # The snapshot's token ids as they were encoded (base64 IntLists):
        # a later state is recognised by comparing encodings.
        self.prompt = st["prompt_token_ids"]
        self.output = st["output_token_ids"]
        self.n_output = len(req.prompt_token_ids) - req._vhi_origin[0]
        self.sampling = st["engine_state"]["sampling_params"]
        sp = req.sampling_params
        # The limits as the client sent them (the Request's are shrunk by
        # the output it already has).
        self.max_tokens = None if sp.max_tokens is None else sp.max_tokens + self.n_output
        self.min_tokens = sp.min_tokens + self.n_output if sp.min_tokens else 0
        self.expires = 0.0

    def leads_to(self, st: dict, tokens_only: bool = False) -> bool:
        """Whether st is this request's state now or later: the same prompt
        and sampling parameters, an output that begins with the staged one.
        A tokens-only snapshot (a top-up) may leave the sampling out."""
        sp = (st.get("engine_state") or {}).get("sampling_params")
        if sp != self.sampling and not (tokens_only and sp is None):
            return False
        return continues(st, self.prompt, self.output, self.n_output)

    def takes_tail(self, st: dict) -> bool:
        """Whether st, a state that carries only the output tokens after
        st["output_from"], reaches back to what is staged (wire.tail_reaches)."""
        return tail_reaches(st, self.n_output)

    def caught_up(self, st: dict):
        """The Request brought to st (which leads_to or takes_tail said is a
        later state): the tokens generated since join its prompt, as the
        source's output did at the stage, and its limits shrink by them."""
        req = self.req
        if "output_from" in st:
            delta = tail_after(st, self.n_output)
        else:
            delta = ints_after(st["output_token_ids"], self.n_output)
        if delta:
            req.prompt_token_ids.extend(delta)
            req._all_token_ids.extend(delta)
            req.num_prompt_tokens += len(delta)
            self.n_output += len(delta)
            sp = req.sampling_params
            if self.max_tokens is not None:
                sp.max_tokens = req.max_tokens = max(1, self.max_tokens - self.n_output)
            if self.min_tokens:
                sp.min_tokens = max(0, self.min_tokens - self.n_output)
            req.update_block_hashes()  # the blocks the new tokens completed
        if "output_from" not in st:
            self.output = st["output_token_ids"]  # a tail is not the whole output's encoding
        return req

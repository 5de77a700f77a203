"""Patches of vLLM's API server that the hooks rely on: the capture of each
stream's metadata on the source (model, created, usage options, prompt
length), and the silencing of a stream whose request moved away."""

from __future__ import annotations

import inspect
import json

from .hooks import SILENCED, STREAMS


def _wrap_stream_generator(cls, name: str, kind: str) -> None:
    orig = getattr(cls, name)
    if getattr(orig, "_vllm_hi", False):
        return
    sig = inspect.signature(orig)

    async def wrapped(self, *args, **kwargs):
        a = sig.bind(self, *args, **kwargs).arguments
        req, rid = a["request"], a["request_id"]
        opts = getattr(req, "stream_options", None)
        meta = {"kind": kind, "model": a.get("model_name", ""),
                "include_usage": bool(opts and opts.include_usage) or bool(getattr(self, "enable_force_include_usage", False)),
                "continuous_usage": bool(opts and opts.include_usage and opts.continuous_usage_stats),
                "return_token_ids": bool(getattr(req, "return_token_ids", False))}
        if "created_time" in a:
            meta["created"] = a["created_time"]
        STREAMS[rid] = meta
        agen = orig(self, *args, **kwargs)
        try:
            async for chunk in agen:
                if rid in SILENCED:
                    break  # moved to another engine: end without a finish chunk
                if "created" not in meta and chunk.startswith("data: {"):
                    try:
                        meta["created"] = json.loads(chunk[6:])["created"]
                    except (ValueError, KeyError):
                        pass
                yield chunk
        finally:
            await agen.aclose()
            STREAMS.pop(rid, None)
            SILENCED.discard(rid)

    wrapped._vllm_hi = True
    setattr(cls, name, wrapped)


def wrap_prompt_len() -> None:
    """Records each stream's prompt length (usage must count the original
    prompt on a target, where the moved output joins the prompt)."""
    from vllm.v1.engine.output_processor import OutputProcessor

    orig = OutputProcessor.add_request
    if getattr(orig, "_vllm_hi", False):
        return

    def add_request(self, request, *args, **kwargs):
        orig(self, request, *args, **kwargs)
        ext = request.external_req_id or request.request_id
        hid = ext[:-2] if ext.startswith("cmpl-") and ext.endswith("-0") else ext
        if hid in STREAMS and "prompt_len" not in STREAMS[hid]:
            STREAMS[hid]["prompt_len"] = len(request.prompt_token_ids or [])

    add_request._vllm_hi = True
    OutputProcessor.add_request = add_request


def patch_serving() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap_stream_generator(OpenAIServingCompletion, "completion_stream_generator", "completion")
    _wrap_stream_generator(OpenAIServingChat, "chat_completion_stream_generator", "chat")

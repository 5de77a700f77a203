"""Where the vLLM versions this plugin supports keep the same things.

Each supported minor release moved a few classes between modules; the
rest of the plugin asks here and never names a version itself. A name
that is in neither place raises ImportError with both tried, so a new
vLLM that moved it again fails at the first use with the reason.
"""

from __future__ import annotations

import importlib


def _first(name: str, *modules: str):
    tried = []
    for mod in modules:
        try:
            return getattr(importlib.import_module(mod), name)
        except (ImportError, AttributeError):
            tried.append(mod)
    raise ImportError(f"vllm-hi: {name} is in none of {', '.join(tried)}")


def usage_info():
    # 0.32: serve/engine/protocol; 0.26: openai/engine/protocol.
    return _first("UsageInfo", "vllm.entrypoints.serve.engine.protocol",
                  "vllm.entrypoints.openai.engine.protocol")


def delta_message():
    # 0.32: generate/base/protocol; 0.26: openai/engine/protocol.
    return _first("DeltaMessage", "vllm.entrypoints.generate.base.protocol",
                  "vllm.entrypoints.openai.engine.protocol")


def kv_cache_layout(cache_config) -> str:
    """The KV layout vLLM resolved ("NHD", "HND"): a CacheConfig method in
    0.32, a module function of the attention backends in 0.26."""
    get = getattr(cache_config, "get_resolved_kv_cache_layout", None)
    if get is None:
        get = _first("get_kv_cache_layout", "vllm.v1.attention.backends.utils")
    layout = get()
    return str(getattr(layout, "name", layout))

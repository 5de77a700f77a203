"""The `vllm.endpoint_plugins` entry point: the `/vllm_hi/engine/*` routes
on vLLM's API server.

hooks.py holds what each hook does, routes.py which route calls which
hook (routes.json, written from the Go side's api/hooks route table),
router.py the FastAPI routes, patches.py the API-server patches the hooks
rely on, agent_process.py the agent the plugin starts.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from . import SUPPORTED_VLLM, agent_process, patches
from .config import load
from .hooks import Hooks
from .router import build_router

log = logging.getLogger("vllm.vllm_hi")


class VhiEndpoints:
    """The `vllm.endpoint_plugins` entry point."""

    name = "vllm_hi"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(build_router(lambda request: getattr(request.app.state, "vllm_hi", None)))

    async def init_state(self, engine_client, state, args) -> None:
        cfg = load()
        if not cfg.enabled or engine_client is None:
            return
        import vllm

        if not vllm.__version__.startswith(SUPPORTED_VLLM):
            raise RuntimeError(f"vllm-hi plugin supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; "
                               f"this is vLLM {vllm.__version__}")
        sc = engine_client.vllm_config.scheduler_config
        if getattr(sc, "async_scheduling", False):
            # vLLM's default: a step is in flight at every boundary, so a
            # pause answers once the paused requests' last step came back
            # (engine_core._pause_op) and the write log's cursor follows the
            # oldest step in flight (wire.WriteLog).
            log.info("vllm-hi: asynchronous scheduling is on: a step is in flight at every boundary")
        patches.patch_serving()
        patches.wrap_prompt_len()
        if not cfg.token:
            log.warning("vllm-hi: the engine hooks are open to anyone who reaches this port; "
                        "give the agent token with VLLM_HI_ENGINE_TOKEN_FILE")
        state.vllm_hi = Hooks(engine_client, state, args, cfg.token)
        agent_process.start(cfg, args)

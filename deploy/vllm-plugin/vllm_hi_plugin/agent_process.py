"""The `vhi agent` the plugin starts beside the engine (VLLM_HI_HOST set,
VLLM_HI_AGENT not "off"), stopped when the API server exits."""

from __future__ import annotations

import atexit
import logging
import os
import subprocess

log = logging.getLogger("vllm.vllm_hi")

_agent: subprocess.Popen | None = None


def agent_env(env) -> dict:
    """The agent's environment: the engine's, less CUDA_VISIBLE_DEVICES.
    That variable picks the engine's GPUs; the agent copies between this
    engine's GPUs and a peer engine's, so it must see both (CUDA IPC opens
    memory only on a visible GPU). It finds each engine's GPU by the UUID
    in the layout, whatever numbering the engine had."""
    return {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}


def start(cfg, args) -> None:
    global _agent
    if not cfg.host or cfg.agent == "off":
        return
    port = getattr(args, "port", 8000)
    cmd = [cfg.agent, "agent", "--host", cfg.host, "--engine", f"http://127.0.0.1:{port}",
           "--data-port", str(cfg.data_port), "--transfer-backend", cfg.backend,
           # Stopped only once the API server exits: its engine is gone by
           # then and nothing is left to drain (a separate agent can drain
           # on SIGTERM: docs/operations.md).
           "--drain-grace", "0"]
    if cfg.token_file:
        cmd += ["--token-file", cfg.token_file]
    if cfg.type:
        cmd += ["--type", cfg.type]
    if cfg.id:
        cmd += ["--id", cfg.id]
    if cfg.core_socket:
        cmd += ["--engine-core-socket", cfg.core_socket]
    try:
        _agent = subprocess.Popen(cmd, env=agent_env(os.environ))
    except OSError as e:
        raise RuntimeError(f"vllm-hi: cannot start the agent ({' '.join(cmd)}): {e}; "
                           f"install vhi on PATH, set VLLM_HI_AGENT to its path, or VLLM_HI_AGENT=off "
                           f"and run `vhi agent` yourself") from e
    log.info("vllm-hi: started %s (pid %d)", " ".join(cmd), _agent.pid)

    def stop():
        if _agent is not None and _agent.poll() is None:
            _agent.terminate()
            try:
                _agent.wait(10)
            except subprocess.TimeoutExpired:
                _agent.kill()

    atexit.register(stop)

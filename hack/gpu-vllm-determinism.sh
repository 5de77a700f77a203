#!/usr/bin/env bash
# The control for exactness runs: is one engine's greedy output the same
# whatever the batch? Serves MODEL_DIR (a random-weight checkpoint, e.g.
# deploy/vllm-plugin/tools/make_tiny_model.py --qwen3 DIR) with
# VLLM_BATCH_INVARIANT=1, eager, prefix caching off — as the exactness
# run of hack/gpu-vllm-suite.sh does — and runs the same 64 greedy
# streams × 1536 tokens three times: all at once, in two batches of 32,
# and started in reverse order 20 ms apart; then compares their token
# ids (no migration anywhere). A stream that differs here differs for
# the engine's own numerics, not for anything a migration did.
#
# Usage: hack/gpu-vllm-determinism.sh MODEL_DIR [OUT]
# Environment: VLLM [python3 -m vllm.entrypoints.cli.main], PORT [18101],
#   GPU_UTIL [0.4], PYTHON [python3]
set -uo pipefail
model=${1:?usage: hack/gpu-vllm-determinism.sh MODEL_DIR [OUT]}
out=${2:-$(mktemp -d -t vhi-determinism-XXXXXX)}
mkdir -p "$out"
port=${PORT:-18101}
read -r -a vllm <<<"${VLLM:-python3 -m vllm.entrypoints.cli.main}"
VLLM_BATCH_INVARIANT=1 setsid "${vllm[@]}" serve "$model" --served-model-name m --port "$port" \
  --max-model-len 4096 --gpu-memory-utilization "${GPU_UTIL:-0.4}" --enforce-eager --no-enable-prefix-caching \
  --max-num-batched-tokens 131072 >"$out/vllm.log" 2>&1 &
pid=$!
trap 'kill -- -$pid 2>/dev/null; sleep 2; kill -9 -- -$pid 2>/dev/null' EXIT
for i in $(seq 1 600); do
  curl -sf "localhost:$port/health" >/dev/null && break
  kill -0 $pid 2>/dev/null || { tail -30 "$out/vllm.log"; exit 3; }
  sleep 1
done
echo "gpu-vllm-determinism: healthy after ${i}s" >&2
"${PYTHON:-python3}" - "http://127.0.0.1:$port" <<'PY'
import json, sys, threading, time, urllib.request

url = sys.argv[1]


def one(i, out):
    body = json.dumps({"model": "m", "prompt": f"Story {i}: the {i * 7} travellers went", "max_tokens": 1536,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        c = json.load(r)["choices"][0]
    out[i] = c.get("token_ids") or c["text"]


def batch(ids, out, stagger=0.0):
    ts = [threading.Thread(target=one, args=(i, out)) for i in ids]
    for t in ts:
        t.start()
        if stagger:
            time.sleep(stagger)
    for t in ts:
        t.join()


runs = []
for k, how in enumerate(["64 at once", "two batches of 32", "64 in reverse order, 20 ms apart"]):
    out = {}
    t0 = time.time()
    if k == 0:
        batch(range(64), out)
    elif k == 1:
        batch(range(32), out)
        batch(range(32, 64), out)
    else:
        batch(range(63, -1, -1), out, 0.02)
    runs.append(out)
    print(f"run {k + 1} ({how}): {len(out)} streams in {time.time() - t0:.1f}s", flush=True)
bad = 0
for k in (1, 2):
    firsts = []
    for i in range(64):
        a, b = runs[0][i], runs[k][i]
        if a != b:
            firsts.append((i, next((n for n in range(min(len(a), len(b))) if a[n] != b[n]), min(len(a), len(b)))))
    bad += len(firsts)
    print(f"run {k + 1} vs run 1: {len(firsts)} of 64 streams differ (stream, first differing token): {firsts}", flush=True)
sys.exit(1 if bad else 0)
PY

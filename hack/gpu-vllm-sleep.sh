#!/usr/bin/env bash
# vLLM's own sleep mode on a GPU, measured: what retiring a source engine
# and model switching build on. Starts one `vllm serve --enable-sleep-mode`
# (the vllm-hi plugin off: no VLLM_HI_* variables), sends a greedy request,
# then for sleep level 1 (weights offloaded to CPU memory, KV discarded):
# times POST /sleep and POST /wake_up, reads the GPU memory in use before,
# asleep and after, and checks that the same request after the wake gives
# the same tokens. Prints one line per step and writes OUT/sleep.txt.
#
# Usage: hack/gpu-vllm-sleep.sh MODEL_DIR [OUT]
# Environment: VLLM, GPU_UTIL [0.4], MAX_MODEL_LEN [4096], SERVE_ARGS,
#   PORT [18100], HEALTH_WAIT_S [900], CYCLES [1] (level-1 cycles),
#   LEVEL2 [0] (1: then a level-2 cycle: weights, reload_weights,
#   kv_cache). Needs curl and nvidia-smi.
set -euo pipefail

model=${1:?usage: hack/gpu-vllm-sleep.sh MODEL_DIR [OUT]}
out=${2:-$(mktemp -d -t vhi-gpu-sleep-XXXXXX)}
mkdir -p "$out"
read -r -a vllm <<<"${VLLM:-python3 -m vllm.entrypoints.cli.main}"
port=${PORT:-18100}
url=http://127.0.0.1:$port
wait_s=${HEALTH_WAIT_S:-900}
log=$out/vllm.log

read -r -a extra <<<"${SERVE_ARGS:-}"
env -u VLLM_HI_TYPE -u VLLM_HI_HOST VLLM_SERVER_DEV_MODE=1 setsid "${vllm[@]}" serve "$model" --port "$port" \
  --served-model-name m --max-model-len "${MAX_MODEL_LEN:-4096}" --gpu-memory-utilization "${GPU_UTIL:-0.4}" \
  --enable-sleep-mode "${extra[@]}" >"$log" 2>&1 &
pid=$!
trap 'kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null || true' EXIT

t0=$SECONDS
until curl -fs -o /dev/null "$url/health"; do
  kill -0 "$pid" 2>/dev/null || { echo "gpu-vllm-sleep: vLLM exited; the end of $log:" >&2; tail -n 40 "$log" >&2; exit 1; }
  ((SECONDS - t0 <= wait_s)) || { echo "gpu-vllm-sleep: not healthy after ${wait_s}s" >&2; exit 1; }
  sleep 1
done

gpu_mib() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1; }
# post PATH: prints the request's wall time in ms, failing on a non-2xx answer.
post() { curl -fsS -o /dev/null -w '%{time_total}' -X POST "$url$1" | awk '{printf "%.1f", $1 * 1000}'; }
tokens() {
  curl -fsS "$url/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model":"m","prompt":"the quick brown fox","max_tokens":32,"temperature":0,"return_token_ids":true}' |
    grep -o '"token_ids":\[[0-9, ]*\]' | tail -n 1
}

# cycle N: one level-1 sleep and wake-up, timed, tokens compared.
cycle1() {
  local awake asleep woken ms_sleep ms_wake is_sleeping t1 ms_first after same
  awake=$(gpu_mib)
  ms_sleep=$(post "/sleep?level=1")
  asleep=$(gpu_mib)
  is_sleeping=$(curl -fsS "$url/is_sleeping")
  ms_wake=$(post "/wake_up")
  woken=$(gpu_mib)
  t1=$(date +%s%N)
  after=$(tokens)
  ms_first=$(( ($(date +%s%N) - t1) / 1000000 ))
  same=no
  [ -n "$before_tokens" ] && [ "$before_tokens" = "$after" ] && same=yes
  echo "sleep level 1 (cycle $1): POST /sleep ${ms_sleep} ms, POST /wake_up ${ms_wake} ms; GPU memory used ${awake} → ${asleep} (asleep, $is_sleeping) → ${woken} MiB"
  echo "first request after the wake (32 tokens): ${ms_first} ms; same tokens as before the sleep: $same"
}

# A level-2 sleep discards the weights: the wake-up is vLLM's documented
# sequence, weights, reload_weights, then the KV cache.
cycle2() {
  local awake asleep ms_sleep ms_w ms_reload ms_kv stale after same
  awake=$(gpu_mib)
  ms_sleep=$(post "/sleep?level=2")
  asleep=$(gpu_mib)
  ms_w=$(post "/wake_up?tags=weights")
  ms_reload=$(curl -fsS -o /dev/null -w '%{time_total}' -X POST "$url/collective_rpc" -H 'Content-Type: application/json' \
    -d '{"method":"reload_weights"}' | awk '{printf "%.1f", $1 * 1000}')
  ms_kv=$(post "/wake_up?tags=kv_cache")
  after=$(tokens)
  same=no
  [ -n "$before_tokens" ] && [ "$before_tokens" = "$after" ] && same=yes
  echo "sleep level 2: POST /sleep ${ms_sleep} ms (GPU ${awake} → ${asleep} MiB), wake weights ${ms_w} ms, reload_weights ${ms_reload} ms, wake kv_cache ${ms_kv} ms; same tokens as before the sleep: $same"
}

{
  echo "gpu-vllm-sleep: $model, healthy after $((SECONDS - t0)) s, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  before_tokens=$(tokens)
  for ((c = 1; c <= ${CYCLES:-1}; c++)); do cycle1 "$c"; done
  [ "${LEVEL2:-0}" = 1 ] && cycle2
  true
} | tee "$out/sleep.txt"
[ "$(grep -c 'same tokens as before the sleep: no' "$out/sleep.txt")" = 0 ]

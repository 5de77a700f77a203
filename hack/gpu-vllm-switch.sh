#!/usr/bin/env bash
# Model switching on real vLLM: two `vllm serve --enable-sleep-mode`
# engines of MODEL_DIR share one GPU. `vhi launch` starts them one by one
# (each put to sleep, then the first woken), a Host with --config routes
# by alias, and requests alternate between the two aliases, each one's
# switch (drain, sleep, wake, probe) done by the Host; then `vhi state`
# and `vhi stop`. Prints each request's time and each switch's steps, and
# writes OUT/switch.txt and OUT/state.json.
#
# Usage: hack/gpu-vllm-switch.sh MODEL_DIR [OUT]
# Environment: VHI (the vhi binary), VLLM, GPU_UTIL [0.4], SERVE_ARGS
#   (e.g. "--load-format dummy --enforce-eager"), ROUNDS [3]. Needs curl.
set -euo pipefail

model=${1:?usage: hack/gpu-vllm-switch.sh MODEL_DIR [OUT]}
out=${2:-$(mktemp -d -t vhi-gpu-switch-XXXXXX)}
mkdir -p "$out"
vhi=${VHI:-vhi}
read -r -a vllm <<<"${VLLM:-python3 -m vllm.entrypoints.cli.main}"
read -r -a extra <<<"${SERVE_ARGS:-}"
host=127.0.0.1:${HOST_PORT:-18002}

# argv NAME PORT: a model's launch_command as a YAML flow list. The plugin
# stays off (no VLLM_HI_* variables); the dev routes serve /sleep.
argv() {
  local a=(env -u VLLM_HI_TYPE -u VLLM_HI_HOST VLLM_SERVER_DEV_MODE=1 "${vllm[@]}" serve "$model" --port "$2"
    --served-model-name "$1" --max-model-len 4096 --gpu-memory-utilization "${GPU_UTIL:-0.4}" --enable-sleep-mode "${extra[@]}")
  local s="[" sep=""
  for x in "${a[@]}"; do s+="$sep\"$x\""; sep=", "; done
  echo "$s]"
}
cat >"$out/host.yaml" <<EOF
models:
  model-a:
    backend_url: http://127.0.0.1:18201
    group: gpu0
    launch_command: $(argv model-a 18201)
  model-b:
    backend_url: http://127.0.0.1:18202
    group: gpu0
    launch_command: $(argv model-b 18202)
controller:
  startup_awake_model: model-a
  switch_timeout_s: 300
EOF

"$vhi" launch --config "$out/host.yaml" --pid-file "$out/pool.json" --ready-timeout 15m | tee "$out/launch.txt"
trap '"$vhi" stop --pid-file "$out/pool.json" --grace 20s || true; kill -TERM "$hostpid" 2>/dev/null || true' EXIT
"$vhi" host --listen "$host" --config "$out/host.yaml" --data-dir "$out/host" --log-level warn >"$out/host.log" 2>&1 &
hostpid=$!
until curl -fs -o /dev/null "http://$host/health"; do sleep 0.2; done
adm=(--host "http://$host" --admin-token-file "$out/host/admin-token")
until "$vhi" state "${adm[@]}" -o json | grep '"state": "awake"' >/dev/null; do sleep 0.5; done

# ask MODEL: one greedy 32-token completion through the Host, timed.
ask() {
  curl -fsS -o /dev/null -w '%{time_starttransfer} %{time_total}\n' "http://$host/v1/completions" \
    -H 'Content-Type: application/json' \
    -d "{\"model\":\"$1\",\"prompt\":\"the quick brown fox\",\"max_tokens\":32,\"temperature\":0}"
}
{
  for ((r = 1; r <= ${ROUNDS:-3}; r++)); do
    for m in model-b model-a; do
      read -r first total < <(ask "$m")
      echo "round $r: request for $m (asleep: queued behind its switch) answered in ${total} s"
      "$vhi" state "${adm[@]}" -o json | python3 -c "
import json, sys
s = json.load(sys.stdin)['models']['$m']['last_switch']
print('  switch from %s: %.3f s (drain %.3f s: %s); %s' % (s.get('from', '-'), s['duration_s'], s['drain_s'], s.get('drain', ''),
      ', '.join('%s %s %.3f s' % (x['step'], x['model'], x['duration_s']) for x in s['steps'])))"
    done
  done
  read -r first total < <(ask model-a)
  echo "a request for the awake model-a: ${total} s"
} | tee "$out/switch.txt"
"$vhi" state "${adm[@]}" -o json >"$out/state.json"
"$vhi" state "${adm[@]}"

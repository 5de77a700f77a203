#!/usr/bin/env bash
# The GPU runs of docs/vllm-plugin.md ("GPU vLLM") in one go, on a machine
# with vLLM (CUDA) and the vllm-hi plugin installed, from the repository
# root. Each step's report lands in OUT; a failed step does not stop the
# next, and the exit status says whether any failed.
#   1. the CUDA IPC export test (a second process reads what torch wrote);
#   2. exactness: hack/gpu-vllm-bench.sh on a random-weight Qwen3 with the
#      8B's KV geometry, batch-invariant engines, prefix caching off and a
#      token budget that prefills every prompt in one piece (vLLM's numerics
#      follow its prefill chunks: without these, some streams differ from
#      their reference before anything moved);
#   3. the seed's full load (256 × 1024) and then its single long sequence
#      (8192 tokens) on one pair of engines: the 8B shape with dummy
#      weights, CUDA graphs on;
#   4. vLLM's own sleep/wake (hack/gpu-vllm-sleep.sh).
#
# Usage: hack/gpu-vllm-suite.sh QWEN3_8B_SHAPE_DIR [OUT]
#   QWEN3_8B_SHAPE_DIR: a config-only Qwen3-8B directory (served with
#   --load-format dummy), e.g. from ../shared/gpu-vllm/make_models.py.
# Environment: VHI, VLLM as for gpu-vllm-bench.sh; PYTHON [python3];
#   STEPS [1 2 3 4].
set -uo pipefail

shape=${1:?usage: hack/gpu-vllm-suite.sh QWEN3_8B_SHAPE_DIR [OUT]}
out=${2:-$(mktemp -d -t vhi-gpu-suite-XXXXXX)}
py=${PYTHON:-python3}
mkdir -p "$out"
failed=()

step() {
  local n=$1 what=$2
  shift 2
  [[ " ${STEPS:-1 2 3 4} " == *" $n "* ]] || return 0
  echo "== $n. $what" >&2
  "$@" || failed+=("$n ($what)")
}

step 1 "CUDA IPC export" bash -c "cd deploy/vllm-plugin/tests && '$py' -m unittest -v test_kvdesc_cuda test_kvdesc 2>&1 | tee '$out/unittest.txt'; exit \${PIPESTATUS[0]}"

exactness() {
  "$py" deploy/vllm-plugin/tools/make_tiny_model.py --qwen3 "$out/qwen3-random" >/dev/null &&
    VLLM_BATCH_INVARIANT=1 OUT="$out/exact" \
      SERVE_ARGS="--enforce-eager --no-enable-prefix-caching --max-num-batched-tokens 131072" \
      hack/gpu-vllm-bench.sh "$out/qwen3-random" --streams 64 --max-tokens 1536 --delay 3s --final-granularity slot,block
}
step 2 "exactness: random weights, batch-invariant engines" exactness

# The target reserves each moved request's whole length (prompt +
# max_tokens): 0.44 of an H200 holds 256 × (~100-word prompt + 1024), and
# one 8192-token sequence at the longer context.
step 3 "the seed's full load, then its single long sequence: the 8B shape, dummy weights, CUDA graphs on" \
  env GPU_UTIL=0.44 OUT="$out/seed" MAX_MODEL_LEN=10240 SERVE_ARGS="--load-format dummy" \
  hack/gpu-vllm-bench.sh "$shape" --streams 256 --max-tokens 1024 --prompt-words 100 --delay 10s --final-granularity slot,block \
  -- --streams 1 --max-tokens 8192 --prompt-words 200 --delay 30s --final-granularity slot

step 4 "vLLM sleep mode: sleep and wake of the 8B shape" \
  env SERVE_ARGS="--load-format dummy" hack/gpu-vllm-sleep.sh "$shape" "$out/sleep"

echo "gpu-vllm-suite: reports in $out (unittest.txt, exact/, seed/, sleep/)" >&2
if ((${#failed[@]})); then
  echo "gpu-vllm-suite: failed: ${failed[*]}" >&2
  exit 1
fi

#!/usr/bin/env bash
# The two-GPU runs (docs/benchmarks.md, "Two GPUs") in one go, from the
# repository root of a machine with two GPUs of one node: GPU_A → GPU_B.
# Each step's report lands in OUT; a failed step does not stop the next,
# and the exit status says whether any failed.
#   1. vhi bench cuda-copy: 10,000 scattered blocks of 2.36 MB and of 64 KiB
#      against one large copy, GPU_A → GPU_B;
#   2. the process-level e2e migrations with GPU KV: A on GPU_A, B on
#      GPU_B, every reshape case with its ranks spread over both GPUs;
#   3. the sim's full load at Qwen3-8B geometry, A on GPU_A → B on GPU_B,
#      whole-block and token-slot final rounds;
#   4. the same load TP1 (GPU_A) → TP2 (GPU_A, GPU_B);
#   5. real vLLM (the plugin installed): the seed's full load, A on GPU_A,
#      B on GPU_B (hack/gpu-vllm-bench.sh, GPUS_A / GPUS_B);
#   6. real vLLM TP1 (GPU_A) → TP2 (GPU_A, GPU_B).
# With GPU_B equal to GPU_A it rehearses steps 1–5 on one GPU (the per-GPU
# code runs, the GPUs are one); step 6 needs two.
#
# Usage: hack/gpu2-suite.sh OUT
# Environment (defaults in brackets):
#   VHI        the vhi binary [bin/vhi]
#   E2E        the e2e test binary (CGO_ENABLED=1 go test -c ./test/e2e) [step 2 skipped without it]
#   SHAPE      a config-only Qwen3-8B directory for steps 5–6 (../shared/gpu-vllm/make_models.py)
#   GPU_A, GPU_B  CUDA ordinals [0, 1]
#   STEPS      [1 2 3 4 5 6]
#   SERVE_ARGS for steps 5–6 [--load-format dummy]
set -uo pipefail

out=${1:?usage: hack/gpu2-suite.sh OUT}
mkdir -p "$out"
vhi=$(realpath "${VHI:-bin/vhi}")
a=${GPU_A:-0} b=${GPU_B:-1}
failed=()

step() {
  local n=$1 what=$2
  shift 2
  [[ " ${STEPS:-1 2 3 4 5 6} " == *" $n "* ]] || return 0
  echo "== $n. $what (GPU $a → GPU $b)" >&2
  "$@" || failed+=("$n ($what)")
}

step 1 "scattered blocks against one large copy" \
  bash -c "'$vhi' bench cuda-copy --src-device $a --dst-device $b --blocks 10000 --reps 5 --block-bytes 2359296,65536 | tee '$out/cuda-copy.txt'; exit \${PIPESTATUS[0]}"

e2e() {
  [ -n "${E2E:-}" ] || { echo "gpu2-suite: no E2E test binary: step 2 skipped" >&2; return 1; }
  VHI_E2E_BIN=$vhi VHI_E2E_SIM_DEVICES=cuda:$a,cuda:$b,cuda:$a VHI_E2E_SIM_RANK_GPUS=cuda:$a,cuda:$b \
    "$E2E" -test.run 'TestMigrationCases|TestMigrationEveryStreamExact|TestEnginesWokenAfterRetirementMigrateExactly' -test.v >"$out/e2e.txt" 2>&1
  local rc=$?
  grep -E '^(--- |ok|FAIL|PASS)' "$out/e2e.txt" >&2
  return $rc
}
step 2 "e2e migrations with GPU KV, ranks spread over both GPUs" e2e

# The full load of docs/benchmarks.md: 256 streams × 300 tokens, 2.36 MB
# blocks, migration 6 s in.
full=(--kv-scale 1 --num-blocks 12000 --max-num-batched-tokens 1024 --streams 256 --max-tokens 300 --prompt-words 400
  --delay 6s --final-granularity block,slot)
step 3 "the sim's full load, Qwen3-8B-sized KV" \
  bash -c "'$vhi' bench migrate --device-a cuda:$a --device-b cuda:$b ${full[*]} --json '$out/full.json' | tee '$out/full.txt'; exit \${PIPESTATUS[0]}"
step 4 "the sim's full load, TP1 → TP2" \
  bash -c "'$vhi' bench migrate --device-a cuda:$a --device-b cuda:$a,cuda:$b --tp-b 2 ${full[*]} --json '$out/full-tp2.json' | tee '$out/full-tp2.txt'; exit \${PIPESTATUS[0]}"

vllm_run() {
  local name=$1
  shift
  [ -n "${SHAPE:-}" ] || { echo "gpu2-suite: no SHAPE model directory: step skipped" >&2; return 1; }
  env VHI="$vhi" OUT="$out/$name" GPU_UTIL="${GPU_UTIL:-0.44}" MAX_MODEL_LEN=10240 SERVE_ARGS="${SERVE_ARGS:---load-format dummy}" "$@" \
    hack/gpu-vllm-bench.sh "$SHAPE" --streams 256 --max-tokens 1024 --prompt-words 100 --delay 10s --final-granularity slot,block
}
step 5 "real vLLM, the seed's full load" vllm_run vllm GPUS_A="$a" GPUS_B="$b"
step 6 "real vLLM, TP1 → TP2" vllm_run vllm-tp2 GPUS_A="$a" GPUS_B="$a,$b" SERVE_ARGS_B="--tensor-parallel-size 2"

echo "gpu2-suite: reports in $out" >&2
if ((${#failed[@]})); then
  echo "gpu2-suite: failed: ${failed[*]}" >&2
  exit 1
fi

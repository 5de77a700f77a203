#!/usr/bin/env bash
# The GPU runs of docs/vllm-plugin.md ("GPU vLLM") in one go, on a machine
# with vLLM (CUDA) and the vllm-hi plugin installed, from the repository
# root: the CUDA IPC export test, then hack/gpu-vllm-bench.sh twice —
# exactness on a random-weight Qwen3 with the 8B's KV geometry
# (VLLM_BATCH_INVARIANT=1), and the seed's full-load timing run on the 8B
# shape with dummy weights. Each step's report lands in OUT.
#
# Usage: hack/gpu-vllm-suite.sh QWEN3_8B_SHAPE_DIR [OUT]
#   QWEN3_8B_SHAPE_DIR: a config-only Qwen3-8B directory (served with
#   --load-format dummy), e.g. from ../shared/gpu-vllm/make_models.py.
# Environment: VHI, VLLM, GPU_UTIL as for gpu-vllm-bench.sh; PYTHON [python3].
set -euo pipefail

shape=${1:?usage: hack/gpu-vllm-suite.sh QWEN3_8B_SHAPE_DIR [OUT]}
out=${2:-$(mktemp -d -t vhi-gpu-suite-XXXXXX)}
py=${PYTHON:-python3}
mkdir -p "$out"

echo "== 1. CUDA IPC export (a second process reads the bytes torch wrote)" >&2
(cd deploy/vllm-plugin/tests && "$py" -m unittest -v test_kvdesc_cuda test_kvdesc) 2>&1 | tee "$out/unittest.txt"

echo "== 2. exactness: random weights, batch-invariant engines" >&2
"$py" deploy/vllm-plugin/tools/make_tiny_model.py --qwen3 "$out/qwen3-random"
VLLM_BATCH_INVARIANT=1 OUT="$out/exact" SERVE_ARGS="--enforce-eager" \
  hack/gpu-vllm-bench.sh "$out/qwen3-random" --streams 64 --max-tokens 512 --delay 3s --final-granularity slot,block

echo "== 3. the seed's full load: the 8B shape, dummy weights, CUDA graphs on" >&2
OUT="$out/full-load" SERVE_ARGS="--load-format dummy" \
  hack/gpu-vllm-bench.sh "$shape" --streams 256 --max-tokens 1024 --prompt-words 200 --delay 10s --final-granularity slot,block

echo "gpu-vllm-suite: reports in $out (unittest.txt, exact/bench.txt, full-load/bench.txt)" >&2

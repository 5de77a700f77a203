#!/usr/bin/env bash
# Generates the Go code of proto/ under OUT (default: the repository root).
# Needs the pinned tools that `make proto-tools` installs under .dev/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.}
mkdir -p "$out"
PATH="$PWD/.dev/bin:$PATH" .dev/venv/bin/python -m grpc_tools.protoc -Iproto \
  --go_out="$out" --go_opt=module=github.com/vllm-hi/vllm-hi \
  --go-grpc_out="$out" --go-grpc_opt=module=github.com/vllm-hi/vllm-hi \
  proto/vllmhi/v1/*.proto

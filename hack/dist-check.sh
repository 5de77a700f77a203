#!/usr/bin/env bash
# Installs dist/'s amd64 .deb on this machine (root), checks what it put
# where, runs `vhi version` and the demo from the installed binary, checks
# the archives against SHA256SUMS and that the plugin's wheel installs,
# then removes the package. Part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DIST:-dist}
[ "$(id -u)" = 0 ] || { echo "dist-check installs a .deb: run it as root" >&2; exit 1; }
(cd "$out" && sha256sum --quiet -c SHA256SUMS)
deb=$(ls "$out"/vllm-hi_*_amd64.deb)
# dpkg-deb -f, not a pipe into grep -q: under pipefail, grep leaving at its
# first match can end the writer with SIGPIPE (exit 141).
[ "$(dpkg-deb -f "$deb" Package)" = vllm-hi ] || { echo "dist-check: $deb is not the vllm-hi package" >&2; exit 1; }
if dpkg -s vllm-hi >/dev/null 2>&1; then dpkg -r vllm-hi >/dev/null; fi
dpkg -i "$deb" >/dev/null
trap 'dpkg -r vllm-hi >/dev/null' EXIT
units=(vhi-host.service vhi-agent@.service vhi-sim.service vllm-hi-engine@.service)
for f in /usr/bin/vhi "${units[@]/#//lib/systemd/system/}"; do
  [ -e "$f" ] || { echo "dist-check: the .deb did not install $f" >&2; exit 1; }
done
getent passwd vllm-hi >/dev/null || { echo "dist-check: the .deb did not create the vllm-hi user" >&2; exit 1; }
[ "$(stat -c %G:%a /etc/vllm-hi)" = vllm-hi:750 ] || { echo "dist-check: /etc/vllm-hi is $(stat -c %G:%a /etc/vllm-hi)" >&2; exit 1; }
# The units as systemd reads them (the engine's with vhi standing in for
# vllm, which is not installed here).
if command -v systemd-analyze >/dev/null; then
  tmp=$(mktemp -d)
  sed 's#/opt/vllm/bin/vllm serve#/usr/bin/vhi sim#' /lib/systemd/system/vllm-hi-engine@.service >"$tmp/vllm-hi-engine@8000.service"
  systemd-analyze verify /lib/systemd/system/vhi-host.service /lib/systemd/system/vhi-sim.service \
    /lib/systemd/system/vhi-agent@8000.service "$tmp/vllm-hi-engine@8000.service"
  rm -rf "$tmp"
fi
v=$(/usr/bin/vhi version)
echo "dist-check: $v"
case "$v" in
  *"commit unknown"*) echo "dist-check: the packaged vhi does not say its commit" >&2; exit 1 ;;
esac
grep -q "ExecStart=/usr/bin/vhi " /lib/systemd/system/vhi-host.service || { echo "dist-check: vhi-host.service does not run /usr/bin/vhi" >&2; exit 1; }
# The demo from the installed binary (a Host, two sims and their agents in
# one process: a migration under load, every stream exact).
/usr/bin/vhi demo >/tmp/vhi-dist-demo.log 2>&1 || { cat /tmp/vhi-dist-demo.log; exit 1; }
tail -n 3 /tmp/vhi-dist-demo.log
# The plugin's wheel installs (without vLLM, which it does not depend on).
venv=$(mktemp -d)
python3 -m venv "$venv"
# Its files are the module vllm_hi_plugin alone: nothing a package with the
# module vllm_hi (PyPI's vllm-hi, another project's) would overwrite.
python3 - "$out"/vllm_hi_plugin-*.whl <<'PY'
import sys, zipfile
tops = {n.split("/")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist()}
mods = {t for t in tops if not t.endswith((".dist-info", ".data"))}
if mods != {"vllm_hi_plugin"}:
    sys.exit(f"dist-check: the plugin's wheel installs {sorted(mods)}, want only vllm_hi_plugin")
PY
"$venv/bin/pip" install -q --no-deps "$out"/vllm_hi_plugin-*.whl
"$venv/bin/python" -c 'import importlib.metadata as m, vllm_hi_plugin; print("dist-check: plugin", m.version("vllm-hi-plugin"))'
rm -rf "$venv"

#!/usr/bin/env bash
# The release artifacts, in DIST (dist/): vhi for linux amd64 and arm64 as
# tar.gz archives (the binary, README, LICENSE, the systemd units), a .deb
# of each (nfpm, deploy/nfpm.yaml), the vLLM plugin's wheel and sdist, and
# SHA256SUMS. Reproducible: the same commit gives the same bytes (-trimpath,
# no build id, no VCS stamp but the version and commit, archive entries
# dated by the commit and owned by root, gzip without a name or time).
# arm64 is built with cgo through Debian's gcc-aarch64-linux-gnu (make
# dist installs it where missing).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${VERSION:-$(git describe --tags --always --dirty 2>/dev/null || echo 0.1.0-dev)}
version=${version#v}
# Debian's version: digits first, and "+" where git describe puts "-"
# (1.2.3-4-gabc → 1.2.3+4+gabc sorts after 1.2.3; a bare commit → 0.0.0+abc).
debversion=${version//-/+}
[[ $debversion =~ ^[0-9] ]] || debversion=0.0.0+$debversion
commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
out=${DIST:-dist}
go=${GO:-go}
nfpm=("$go" run "github.com/goreleaser/nfpm/v2/cmd/nfpm@${NFPM_VERSION:-v2.48.0}")
pkg=github.com/vllm-hi/vllm-hi/internal/version
rm -rf "$out"
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for arch in amd64 arm64; do
  cc=gcc
  [ "$arch" = arm64 ] && cc=aarch64-linux-gnu-gcc
  name=vhi_${version}_linux_${arch}
  mkdir -p "$work/$name/systemd"
  # go-nvml's cgo wrappers call NVML functions its header marks deprecated.
  CGO_ENABLED=1 GOOS=linux GOARCH=$arch CC=$cc CGO_CFLAGS="-O2 -Wno-deprecated-declarations" \
    "$go" build -trimpath -buildvcs=false \
    -ldflags "-s -w -buildid= -X $pkg.version=$version -X $pkg.commit=$commit" -o "$work/$name/vhi" ./cmd/vhi
  cp README.md LICENSE "$work/$name/"
  cp deploy/systemd/*.service "$work/$name/systemd/"
  touch -d "@$epoch" "$work/$name" "$work/$name"/* "$work/$name"/systemd/*
  tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner -C "$work" -cf - "$name" | gzip -n -9 >"$out/$name.tar.gz"
  sed -e "s|\${VERSION}|$debversion|; s|\${ARCH}|$arch|; s|\${BIN}|$work/$name/vhi|" deploy/nfpm.yaml >"$work/nfpm-$arch.yaml"
  SOURCE_DATE_EPOCH=$epoch "${nfpm[@]}" package -f "$work/nfpm-$arch.yaml" -p deb -t "$out/" >/dev/null
done
# The plugin: wheel and sdist, built in a virtual environment of the
# project's own (PyPI's build and setuptools).
venv=${DIST_VENV:-.dev/dist-venv}
if [ ! -x "$venv/bin/pyproject-build" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q build==1.6.1
fi
# setuptools' leftovers of earlier builds in the checkout (build/, the
# egg-info) can carry files that are gone, a renamed module's say.
rm -rf deploy/vllm-plugin/build deploy/vllm-plugin/*.egg-info
SOURCE_DATE_EPOCH=$epoch "$venv/bin/pyproject-build" -q --sdist --wheel --outdir "$out" deploy/vllm-plugin >/dev/null
# setuptools' sdist stamps its archive with the time of the build: packed
# again as the vhi archives are, it is the same bytes every time.
for sdist in "$out"/vllm_hi_plugin-*.tar.gz; do
  top=$(basename "$sdist" .tar.gz)
  mkdir -p "$work/sdist" && tar -xzf "$sdist" -C "$work/sdist"
  tar --sort=name --mtime="@$epoch" --owner=0 --group=0 --numeric-owner -C "$work/sdist" -cf - "$top" | gzip -n -9 >"$sdist"
done
(cd "$out" && sha256sum -- * >SHA256SUMS)
ls -l "$out"

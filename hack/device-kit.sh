#!/usr/bin/env bash
# The lent device machine's kit: what a session builds here and carries
# there, and the runs it makes there. From the repository root.
#
# Here (needs Go with cgo, PyPI, Debian's packages):
#   hack/device-kit.sh build
# writes, into paths git ignores (.git/info/exclude gets them): .v01 … .v04,
# the vLLM 0.26.0 CUDA wheel set of ../shared/gpu-vllm cut into folders of
# ≤ 55 MiB (a call carries ≤ 64 MiB with the working tree), and .gpu/: vhi
# (cgo, gzipped), the plugin's wheel, the config-only models of
# make_models.py, nginx with its libraries, hack/relayfloor, this script and
# install-on-device.sh. Then chain the calls (the machine goes back 30 s
# after one ends):
#   carry [".v01"] … [".v03"]: bash .gpu/install-on-device.sh stage
#   carry [".gpu", ".v04"]:     bash .gpu/device-kit.sh setup STEP…
# or, without vLLM: carry [".gpu", ".gput"]: bash .gpu/device-kit.sh vhionly STEP…
# (.gput/: the GPU tests, for the gputests step)
#
# There, STEP is one of (each writes under $OUT/STEP):
#   copy      vhi bench cuda-copy, 2.36 MB and 32 KiB pieces, 10,000 and 400,000
#   micro     vhi bench migrate with the sims' KV on cuda:0 at the 8B geometry,
#             256 streams, final rounds slot and block, the pause dropping the
#             step in flight, for each of MICRO_LAYOUTS (default "HND NHD")
#   gputests  the Go tests that need a GPU (built here with go test -c):
#             internal/cuda, internal/transfer/cudaipc, internal/sim
#   proxy     vhi bench proxy at 1k/2k/3k streams against nginx and the relay floor
#   seed      hack/gpu-vllm-bench.sh, the seed's full load on real vLLM (SEED_ARGS
#             to cut it, e.g. "--streams 256 --max-tokens 400 --prompt-words 40
#             --delay 3s --final-granularity slot,block" for an H100)
#   failover  BENCH=failover on real vLLM, the busiest engine killed (FO_ARGS, FO_UTIL)
#   warm      the same with warm standbys
set -uo pipefail

build() {
  set -e
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || printf '/.v[0-9][0-9]/\n/.gpu/\n' >>.git/info/exclude
  grep -qx '/.gput/' .git/info/exclude || printf '/.gput/\n' >>.git/info/exclude
  CAP_MIB=55 ../shared/gpu-vllm/prepare.sh .
  rm -rf .gpu && mkdir -p .gpu/ngx/lib
  cp hack/device-kit.sh ../shared/gpu-vllm/install-on-device.sh .gpu/
  CGO_ENABLED=1 CGO_CFLAGS="-O2 -Wno-deprecated-declarations" go build -trimpath -ldflags "-s -w" -o .gpu/vhi ./cmd/vhi
  gzip -f .gpu/vhi
  (cd hack/relayfloor && go build -o ../../.gpu/relayfloor .)
  # The GPU tests apart (.gput/), carried only where no vLLM wheels are.
  rm -rf .gput && mkdir -p .gput
  for p in cuda transfer/cudaipc sim; do
    CGO_ENABLED=1 go test -c -trimpath -ldflags "-s -w" -o ".gput/$(basename $p).test" ./internal/$p
    gzip -f ".gput/$(basename $p).test"
  done
  local venv
  venv=$(hack/vllm-env.sh 0.26.0)
  "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation deploy/vllm-plugin -w .gpu/
  "$venv/bin/python" ../shared/gpu-vllm/make_models.py .gpu/models >/dev/null
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download nginx >/dev/null 2>&1 && dpkg-deb -x nginx_*.deb root)
  cp "$tmp/root/usr/sbin/nginx" .gpu/ngx/
  for l in libcrypt.so.1 libpcre2-8.so.0 libssl.so.3 libcrypto.so.3 libz.so.1; do cp -L "/lib/x86_64-linux-gnu/$l" .gpu/ngx/lib/; done
  rm -rf "$tmp"
  du -sh .gpu .gput .v0*
}

OUT=${OUT:-/tmp/out}
M=/tmp/models
export VHI=/tmp/vhi

vhionly() {
  mkdir -p "$OUT"
  gunzip -c .gpu/vhi.gz >/tmp/vhi && chmod +x /tmp/vhi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/gpu.txt"
}

setup() {
  bash .gpu/install-on-device.sh stage && bash .gpu/install-on-device.sh install || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/vllm_hi_plugin-*.whl || return 1
  rm -rf $M && cp -r .gpu/models $M
  vhionly
}

copy() {
  mkdir -p "$OUT/copy"
  /tmp/vhi bench cuda-copy --src-device 0 --dst-device 0 --reps 5 --blocks 10000 --block-bytes 2359296,32768 2>&1 | tee "$OUT/copy/blocks10k.txt"
  /tmp/vhi bench cuda-copy --src-device 0 --dst-device 0 --reps 5 --blocks 400000 --block-bytes 32768 2>&1 | tee "$OUT/copy/pieces400k.txt"
}

micro() {
  mkdir -p "$OUT/micro"
  for layout in ${MICRO_LAYOUTS:-HND NHD}; do
    /tmp/vhi bench migrate --device-a cuda:0 --device-b cuda:0 --kv-scale 1 --kv-layout "$layout" --num-blocks 12000 \
      --max-num-batched-tokens 1024 --streams 256 --max-tokens 400 --prompt-words 100 --delay 6s \
      --final-granularity slot,block --pause-in-flight drop --json "$OUT/micro/migrate-$layout.json" \
      --log-level debug 2>"$OUT/micro/stderr-$layout.txt" | tee "$OUT/micro/bench-$layout.txt"
    gzip -f "$OUT/micro/stderr-$layout.txt"
  done
}

gputests() {
  mkdir -p "$OUT/gputests"
  for t in cuda cudaipc sim; do
    gunzip -c ".gput/$t.test.gz" >"/tmp/$t.test" && chmod +x "/tmp/$t.test"
  done
  (cd internal/cuda && /tmp/cuda.test -test.count=1 -test.v 2>&1 | tail -40) | tee "$OUT/gputests/cuda.txt"
  (cd internal/transfer/cudaipc && /tmp/cudaipc.test -test.count=1 2>&1 | tail -20) | tee "$OUT/gputests/cudaipc.txt"
  (cd internal/sim && /tmp/sim.test -test.count=1 -test.v -test.run 'TestLayoutsAndDevices' 2>&1 | tail -20) | tee "$OUT/gputests/sim.txt"
}

proxy() {
  mkdir -p "$OUT/proxy" /tmp/ngxbin
  cp .gpu/ngx/nginx /tmp/ngxbin/ && chmod +x /tmp/ngxbin/nginx
  export PATH=/tmp/ngxbin:$PATH
  nginx -v 2>/dev/null || export LD_LIBRARY_PATH=$PWD/.gpu/ngx/lib
  /tmp/vhi bench proxy --levels 1000,2000,3000 --tokens 150 --json "$OUT/proxy/proxy.json" \
    --extra-proxy "$PWD/.gpu/relayfloor -listen {listen} -upstream {upstream}" 2>"$OUT/proxy/stderr.txt" | tee "$OUT/proxy/bench.txt"
}

# keep DIR NAME: a bench's reports and gzipped logs into $OUT/NAME.
keep() {
  mkdir -p "$OUT/$2"
  cp "$1"/*.json "$1"/*.txt "$OUT/$2/" 2>/dev/null
  for f in "$1"/*.log; do [ -e "$f" ] && gzip -c "$f" >"$OUT/$2/$(basename "$f").gz"; done
  cat "$1"/bench*.txt 2>/dev/null | tail -80
}

seed() {
  eval "$(bash .gpu/install-on-device.sh env)"
  # shellcheck disable=SC2086 # SEED_ARGS is a list of flags
  HOST_FLAGS="--log-level debug" VLLM_HI_LOG_LEVEL=debug OUT=/tmp/seed GPU_UTIL=0.44 MAX_MODEL_LEN=4096 \
    SERVE_ARGS="--load-format dummy" timeout 560 bash hack/gpu-vllm-bench.sh $M/qwen3-8b-shape \
    ${SEED_ARGS:---streams 256 --max-tokens 1024 --prompt-words 100 --delay 10s --final-granularity slot,block}
  echo "seed rc=$?"
  keep /tmp/seed seed
}

# failover_run NAME [HOST FLAGS…]: one failover run on a fresh pair of engines.
failover_run() {
  local name=$1
  shift
  eval "$(bash .gpu/install-on-device.sh env)"
  # shellcheck disable=SC2086 # FO_ARGS is a list of flags
  BENCH=failover HOST_FLAGS="--log-level debug $*" OUT=/tmp/$name GPU_UTIL=${FO_UTIL:-0.45} MAX_MODEL_LEN=4096 \
    SERVE_ARGS="--load-format dummy" timeout 560 bash hack/gpu-vllm-bench.sh $M/qwen3-8b-shape \
    ${FO_ARGS:---streams 128 --max-tokens 400 --prompt-words 800 --delay 8s}
  echo "$name rc=$?"
  keep /tmp/$name $name
}

[ $# -gt 0 ] || { sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 2; }
for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    build) build ;;
    setup) setup || { echo "setup failed"; exit 1; } ;;
    vhionly) vhionly ;;
    copy) copy ;;
    micro) micro ;;
    gputests) gputests ;;
    proxy) proxy ;;
    seed) seed ;;
    failover) failover_run failover ;;
    warm) failover_run warm --failover-warm-standby-tokens 1 ;;
    *) echo "device-kit: unknown step $step" >&2; exit 2 ;;
  esac
done
echo "=== done $(date -u +%T)"

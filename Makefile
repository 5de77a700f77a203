# vllm-hi — build, test, lint, demo, bench. `make test` is what CI runs.
SHELL := /bin/bash
GO ?= go
STATICCHECK_VERSION := v0.8.2
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo 0.1.0-dev)
COMMIT ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS := -X github.com/vllm-hi/vllm-hi/internal/version.Version=$(VERSION) \
           -X github.com/vllm-hi/vllm-hi/internal/version.Commit=$(COMMIT)
BIN := bin/vhi

.PHONY: all build test unit lint fmtcheck vet staticcheck demo bench clean

all: build

build:
	CGO_ENABLED=1 $(GO) build -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/vhi

## test: lint, then every test with the race detector (end-to-end tests
## build and run the real binary).
test: lint unit

unit:
	$(GO) test -race -count=1 -timeout 20m ./...

lint: fmtcheck vet staticcheck

fmtcheck:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

staticcheck:
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

demo: build
	./$(BIN) demo

bench: build
	./$(BIN) bench sim

clean:
	rm -rf bin

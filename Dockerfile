# The vllm-hi image the Kubernetes manifests name (vllm-hi:latest): vhi
# alone — the Host, the agent and the sim. Not built on the project's
# development machines (they have no container engine); build it with
#   docker build -t vllm-hi:latest --build-arg VERSION=$(git describe --tags --always) .
# The engine image is vLLM's own with the plugin installed
# (pip install deploy/vllm-plugin; see docs/vllm-plugin.md).
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=0.1.0-dev
# cgo: vhi dlopens libcuda (cuda_ipc) and libnvidia-ml (GPU discovery)
# at run time; without them it runs and says those are unavailable.
RUN CGO_ENABLED=1 go build -trimpath \
      -ldflags "-s -w -X github.com/vllm-hi/vllm-hi/internal/version.Version=${VERSION}" \
      -o /out/vhi ./cmd/vhi

FROM debian:bookworm-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/vllm-hi vhi && mkdir -p /var/lib/vllm-hi && chown vhi /var/lib/vllm-hi
COPY --from=build /out/vhi /usr/local/bin/vhi
USER vhi
ENTRYPOINT ["/usr/local/bin/vhi"]
CMD ["--help"]

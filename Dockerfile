# The vllm-hi image the Helm chart names (vllm-hi, deploy/helm/vllm-hi): vhi
# alone — the Host, the agent and the sim. Not built on the project's
# development machines (they have no container engine); build it with
#   docker build -t vllm-hi:latest --build-arg VERSION=$(git describe --tags --always) .
# The engine image is vLLM's own with the plugin installed
# (pip install deploy/vllm-plugin; see docs/vllm-plugin.md).
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
# api/ is a module of its own that go.mod replaces with the local copy.
COPY api/go.mod api/go.sum ./api/
RUN go mod download
COPY . .
ARG VERSION=0.1.0-dev
# cgo: vhi dlopens libcuda (cuda_ipc), libnvidia-ml (GPU discovery) and
# libucp (the rdma data plane) at run time; without them it runs and says
# those are unavailable.
RUN CGO_ENABLED=1 go build -trimpath \
      -ldflags "-s -w -X github.com/vllm-hi/vllm-hi/internal/version.version=${VERSION}" \
      -o /out/vhi ./cmd/vhi

FROM debian:bookworm-slim
# UCX for the rdma data plane (verbs where the node has an RDMA NIC, TCP and
# shared memory elsewhere); a CUDA-enabled UCX replaces it for GPUDirect.
RUN apt-get update && apt-get install -y --no-install-recommends libucx0 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --home-dir /var/lib/vllm-hi vhi && mkdir -p /var/lib/vllm-hi && chown vhi /var/lib/vllm-hi
COPY --from=build /out/vhi /usr/local/bin/vhi
USER vhi
ENTRYPOINT ["/usr/local/bin/vhi"]
CMD ["--help"]

// Package dataplane builds the KV data plane a copy round goes through:
// the closed table of backends (a new backend is a folder under
// internal/transfer and a case here), each built from one small
// environment that the agent owns.
package dataplane

import (
	"crypto/tls"
	"fmt"

	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
	"github.com/vllm-hi/vllm-hi/internal/transfer/rdma"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// Env is what the backends are built from.
type Env struct {
	// TLS dials peers' data planes (nil: this agent has no TLS).
	TLS *tls.Config
	// GPU is the agent's CUDA state: cuda_ipc's mappings, and the staging
	// of GPU KV for tcp_shm and rdma.
	GPU *cudaipc.Plane
	// RDMA is UCX loaded (nil: not, RDMANote says why).
	RDMA     *rdma.Plane
	RDMANote string
}

// New returns the backend named (transfer.Pick's choice).
func New(name string, env Env) (transfer.Backend, error) {
	frames := tcpshm.Backend{TLS: env.TLS}
	if env.GPU != nil {
		frames.GPU = env.GPU
	}
	switch name {
	case transfer.TCPShm:
		return frames, nil
	case transfer.CUDAIPC:
		if env.GPU == nil {
			return nil, fmt.Errorf("%w: cuda_ipc: this agent has no CUDA plane", transfer.ErrUnsupported)
		}
		return cudaipc.Backend{Plane: env.GPU}, nil
	case transfer.RDMA:
		return rdma.Backend{Plane: env.RDMA, Note: env.RDMANote, Frames: frames}, nil
	}
	return nil, fmt.Errorf("%w: no %s backend in this agent", transfer.ErrUnsupported, name)
}

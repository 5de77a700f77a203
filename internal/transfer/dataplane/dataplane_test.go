package dataplane

import (
	"context"
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
)

// The table builds exactly the backends transfer.Pick can choose.
func TestNewBuildsEveryBackendPickChooses(t *testing.T) {
	env := Env{GPU: cudaipc.NewPlane(zap.NewNop(), nil), RDMANote: "rdma: unavailable: libucp not found"}
	for _, name := range []string{transfer.TCPShm, transfer.CUDAIPC, transfer.RDMA} {
		if b, err := New(name, env); err != nil || b.Name() != name {
			t.Errorf("%s: %v", name, err)
		}
	}
	// Without UCX loaded the rdma backend says why it cannot move a round.
	b, _ := New(transfer.RDMA, env)
	if _, err := b.Send(context.Background(), transfer.Round{}); !errors.Is(err, transfer.ErrUnsupported) || !strings.Contains(err.Error(), "libucp not found") {
		t.Errorf("rdma without UCX: %v", err)
	}
	for _, name := range []string{transfer.Auto, "nope"} {
		if _, err := New(name, env); !errors.Is(err, transfer.ErrUnsupported) {
			t.Errorf("%s: %v", name, err)
		}
	}
	// Without a CUDA plane there is no cuda_ipc.
	if _, err := New(transfer.CUDAIPC, Env{}); !errors.Is(err, transfer.ErrUnsupported) {
		t.Errorf("cuda_ipc without a CUDA plane: %v", err)
	}
}

package rdma

import (
	"context"
	"fmt"

	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// Backend moves a round as tcp_shm frames whose payloads UCX puts into
// the target's registered staging; GPU sides are staged through pinned
// host memory as on tcp_shm.
type Backend struct {
	// Plane is UCX loaded (nil: it is not, and Note says why).
	Plane *Plane
	Note  string
	// Frames is the tcp_shm backend the frames go through.
	Frames tcpshm.Backend
}

var _ transfer.Backend = Backend{}

// Name is transfer.RDMA.
func (Backend) Name() string { return transfer.RDMA }

// Send moves the round.
func (b Backend) Send(ctx context.Context, r transfer.Round) (transfer.Stats, error) {
	if b.Plane == nil {
		return transfer.Stats{}, fmt.Errorf("%w: rdma: %s", transfer.ErrUnsupported, b.Note)
	}
	dest, err := b.Frames.Dest(r.Target)
	if err != nil {
		return transfer.Stats{}, err
	}
	dest.Carrier = b.Plane
	return b.Frames.SendTo(ctx, dest, r)
}

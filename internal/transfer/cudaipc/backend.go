package cudaipc

import (
	"context"

	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// Backend copies a round GPU to GPU through CUDA IPC mappings of both
// engines' KV, from the source GPU (Plane.Copy).
type Backend struct{ Plane *Plane }

var _ transfer.Backend = Backend{}

// Name is transfer.CUDAIPC.
func (Backend) Name() string { return transfer.CUDAIPC }

// Send runs the round's copies.
func (b Backend) Send(_ context.Context, r transfer.Round) (transfer.Stats, error) {
	return b.Plane.Copy(r.Target.Session, r.Src, r.Dst, r.Copies, r.Fault)
}

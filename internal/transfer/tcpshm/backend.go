package tcpshm

import (
	"context"
	"crypto/tls"
	"fmt"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// GPUGatherer stages a GPU source's runs in pinned host memory: the bytes,
// the runs rewritten to read them, and the function that frees them once
// sent (cudaipc.Plane.GatherSource).
type GPUGatherer interface {
	GatherSource(src hooks.Layout, runs []kvlayout.CopyRun) (host []byte, out []kvlayout.CopyRun, release func(), err error)
}

// Backend streams a round to the target agent over TCP: runs of mapped
// host memory, token-slot jobs the target expands with its own layout,
// or — when a side's KV is in GPU memory — runs staged through pinned
// host memory.
type Backend struct {
	// TLS dials a target whose data plane speaks TLS (nil: this agent
	// has no TLS configuration).
	TLS *tls.Config
	// GPU stages a GPU source (nil: none; a round from GPU KV fails).
	GPU GPUGatherer
}

var _ transfer.Backend = Backend{}

// Name is transfer.TCPShm.
func (Backend) Name() string { return transfer.TCPShm }

// Send moves the round.
func (b Backend) Send(ctx context.Context, r transfer.Round) (transfer.Stats, error) {
	dest, err := b.Dest(r.Target)
	if err != nil {
		return transfer.Stats{}, err
	}
	return b.SendTo(ctx, dest, r)
}

// Dest is where a round's frames go: the target's data address and
// session, over TLS when the target's data plane speaks it.
func (b Backend) Dest(t transfer.Target) (Dest, error) {
	dest := Dest{Addr: t.Addr, Session: t.Session, Secret: t.Secret}
	if t.TLS {
		if b.TLS == nil {
			return dest, fmt.Errorf("the target's data plane speaks TLS and this agent has no TLS configuration (--tls-ca-file)")
		}
		dest.TLS = b.TLS
	}
	return dest, nil
}

// SendTo sends a round as frames to dest (their payloads in the stream,
// or through dest's carrier).
func (b Backend) SendTo(ctx context.Context, dest Dest, r transfer.Round) (transfer.Stats, error) {
	dest.Pace = r.Pace
	geo := r.Src.Geometry
	switch {
	case transfer.OnGPU(r.Src) || transfer.OnGPU(r.Dst):
		return b.sendStaged(ctx, dest, r)
	case r.SlotGranular:
		// Token slots: many tiny runs; send them as slot jobs the target
		// expands with its own layout.
		return SendSlots(ctx, dest, r.TN, MemoryOf(r.SrcMemory, r.Src), r.Copies, r.Fault)
	}
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), transfer.Specs(r.Src), transfer.Specs(r.Dst), r.Copies)
	if err != nil {
		return transfer.Stats{}, err
	}
	return Send(ctx, dest, r.TN, r.SrcMemory, runs, r.Fault)
}

// sendStaged sends a round when a side's KV is in GPU memory: always as
// runs (a GPU target scatters runs, not slot jobs), the source's bytes
// gathered into pinned host memory first when it is the GPU side.
func (b Backend) sendStaged(ctx context.Context, dest Dest, r transfer.Round) (transfer.Stats, error) {
	geo := r.Src.Geometry
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), transfer.Specs(r.Src), transfer.Specs(r.Dst), r.Copies)
	if err != nil {
		return transfer.Stats{}, err
	}
	data := r.SrcMemory
	if transfer.OnGPU(r.Src) {
		if b.GPU == nil {
			return transfer.Stats{}, fmt.Errorf("%w: the source's KV is in GPU memory and this agent has no CUDA plane", transfer.ErrUnsupported)
		}
		host, out, release, err := b.GPU.GatherSource(r.Src, runs)
		if err != nil {
			return transfer.Stats{}, err
		}
		defer release()
		data, runs = [][]byte{host}, out
	}
	return Send(ctx, dest, r.TN, data, runs, r.Fault)
}

// MemoryOf is mapped KV (data, in l's region order) as the data plane
// reads and writes it.
func MemoryOf(data [][]byte, l hooks.Layout) *Memory {
	return &Memory{Data: data, Specs: transfer.Specs(l), Layers: l.Geometry.Layers, Heads: l.Geometry.KVHeads,
		SlotBytes: int64(l.Geometry.HeadSlotBytes())}
}

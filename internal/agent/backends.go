package agent

import (
	"context"
	"fmt"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// backend returns the data plane named (a closed set: a new backend is a
// folder under internal/transfer and a case here).
func (a *Agent) backend(name string) (transfer.Backend, error) {
	switch name {
	case transfer.TCPShm:
		return tcpShmBackend{a}, nil
	case transfer.CUDAIPC:
		return cudaIPCBackend{a}, nil
	case transfer.RDMA:
		return rdmaBackend{a}, nil
	}
	return nil, fmt.Errorf("%w: no %s backend in this agent", transfer.ErrUnsupported, name)
}

var (
	_ transfer.Backend = tcpShmBackend{}
	_ transfer.Backend = cudaIPCBackend{}
)

// tcpShmBackend streams a round to the target agent over TCP: runs of
// mapped host memory, token-slot jobs the target expands with its own
// layout, or — when a side's KV is in GPU memory — runs staged through
// pinned host memory.
type tcpShmBackend struct{ a *Agent }

func (tcpShmBackend) Name() string { return transfer.TCPShm }

func (b tcpShmBackend) Send(ctx context.Context, r transfer.Round) (transfer.Stats, error) {
	dest, err := b.a.dataDest(r.Target)
	if err != nil {
		return transfer.Stats{}, err
	}
	return b.a.sendFrames(ctx, dest, r)
}

// dataDest is where a round's frames go: the target's data address and
// session, over TLS when the target's data plane speaks it.
func (a *Agent) dataDest(t transfer.Target) (tcpshm.Dest, error) {
	dest := tcpshm.Dest{Addr: t.Addr, Session: t.Session, Secret: t.Secret}
	if t.TLS {
		if a.clientTLS == nil {
			return dest, fmt.Errorf("the target's data plane speaks TLS and this agent has no TLS configuration (--tls-ca-file)")
		}
		dest.TLS = a.clientTLS
	}
	return dest, nil
}

// sendFrames sends a round as tcp_shm frames (their payloads in the
// stream, or through dest's carrier).
func (a *Agent) sendFrames(ctx context.Context, dest tcpshm.Dest, r transfer.Round) (transfer.Stats, error) {
	geo := r.Src.Geometry
	switch {
	case transfer.OnGPU(r.Src) || transfer.OnGPU(r.Dst):
		return a.sendStaged(ctx, dest, r)
	case r.SlotGranular:
		// Token slots: many tiny runs; send them as slot jobs the target
		// expands with its own layout.
		return tcpshm.SendSlots(ctx, dest, r.TN, memory(r.SrcMemory, r.Src), r.Copies, r.Fault)
	}
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(r.Src), specs(r.Dst), r.Copies)
	if err != nil {
		return transfer.Stats{}, err
	}
	return tcpshm.Send(ctx, dest, r.TN, r.SrcMemory, runs, r.Fault)
}

// sendStaged sends a round over tcp_shm when a side's KV is in GPU
// memory: always as runs (a GPU target scatters runs, not slot jobs), the
// source's bytes gathered into pinned host memory first when it is the
// GPU side.
func (a *Agent) sendStaged(ctx context.Context, dest tcpshm.Dest, r transfer.Round) (transfer.Stats, error) {
	geo := r.Src.Geometry
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(r.Src), specs(r.Dst), r.Copies)
	if err != nil {
		return transfer.Stats{}, err
	}
	data := r.SrcMemory
	if transfer.OnGPU(r.Src) {
		host, out, release, err := a.gatherGPU(r.Src, runs)
		if err != nil {
			return transfer.Stats{}, err
		}
		defer release()
		data, runs = [][]byte{host}, out
	}
	return tcpshm.Send(ctx, dest, r.TN, data, runs, r.Fault)
}

// cudaIPCBackend copies a round GPU to GPU through CUDA IPC mappings of
// both engines' KV, from the source GPU.
type cudaIPCBackend struct{ a *Agent }

func (cudaIPCBackend) Name() string { return transfer.CUDAIPC }

func (b cudaIPCBackend) Send(_ context.Context, r transfer.Round) (transfer.Stats, error) {
	return b.a.cudaCopy(r.Target.Session, r.Src, r.Dst, r.Copies, r.Fault)
}

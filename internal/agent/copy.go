package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/dataplane"
)

func compatible(a, b kvlayout.Geometry) error {
	if a.Layers != b.Layers || a.KVHeads != b.KVHeads || a.HeadDim != b.HeadDim || a.DTypeBytes != b.DTypeBytes || a.BlockSize != b.BlockSize {
		return fmt.Errorf("source and target KV geometries differ: %d layers × %d heads × %d × %dB, block %d vs %d × %d × %d × %dB, block %d",
			a.Layers, a.KVHeads, a.HeadDim, a.DTypeBytes, a.BlockSize, b.Layers, b.KVHeads, b.HeadDim, b.DTypeBytes, b.BlockSize)
	}
	return nil
}

// CopyRound implements the Agent service: read what the engine holds and
// wrote, plan the round (transfer.PlanRound), and move it through the
// backend transfer.Pick chooses.
func (s *agentService) CopyRound(ctx context.Context, req *v1.CopyRoundRequest) (*v1.CopyRoundResponse, error) {
	a := s.a
	start := time.Now()
	var dstLayout hooks.Layout
	if err := json.Unmarshal(req.GetTargetLayout(), &dstLayout); err != nil {
		return nil, errdefs.Newf(errdefs.ErrInvalidArgument, "target_layout: %v", err)
	}
	in, err := a.roundInputs(ctx, req.GetKind() != transfer.KindFull, req.GetSinceCursor())
	if err != nil {
		return nil, err
	}
	tRead := time.Now()
	src, srcLayout, err := a.regionsOf(in.Layout, false)
	if err != nil {
		return nil, err
	}
	geo := srcLayout.Geometry
	if err := compatible(geo, dstLayout.Geometry); err != nil {
		return nil, errdefs.New(errdefs.ErrConflict, err.Error())
	}
	// An engine whose blocks are opaque (vLLM's CPU kernels tile the
	// slots inside a block) gets whole changed blocks instead of slots.
	slotGranular := req.GetSlotGranular() && !srcLayout.OpaqueBlocks && !dstLayout.OpaqueBlocks
	changes, list := in.Changes, in.Requests
	cursor := list.Cursor
	if req.GetKind() != transfer.KindFull {
		cursor = changes.Cursor
	}
	plan := transfer.PlanRound(req.GetKind(), movingFromProto(req.GetRequests()), list.Requests, changes.Written, geo.BlockSize, slotGranular)
	resp := &v1.CopyRoundResponse{Cursor: cursor, DroppedRequestIds: plan.Dropped, BlockCount: int32(len(plan.Copies)), TokenSlots: int32(plan.TokenSlots)}
	for _, mv := range plan.Moving {
		resp.Requests = append(resp.Requests, &v1.RequestBlocks{RequestId: mv.ID, SrcBlockIds: int32s(mv.Src), DstBlockIds: int32s(mv.Dst)})
	}
	tSelect := time.Now()
	name, why, err := a.pickBackend(srcLayout, dstLayout, a.rdmaPeers(req.GetTargetRdma()))
	if err != nil {
		return nil, errdefs.New(errdefs.ErrConflict, err.Error())
	}
	resp.Backend, resp.BackendReason = name, why
	backend, err := dataplane.New(name, a.dataEnv())
	if err != nil {
		return nil, errdefs.New(errdefs.ErrConflict, err.Error())
	}
	tn := int(req.GetTn())
	if tn < 1 {
		tn = a.cfg.DefaultTN
	}
	round := transfer.Round{
		Target: transfer.Target{Addr: req.GetTargetDataAddress(), Session: req.GetMigrationId(), Secret: req.GetSecret(), TLS: req.GetTargetTls()},
		Src:    srcLayout, Dst: dstLayout, Copies: plan.Copies, SlotGranular: slotGranular, TN: tn,
		Fault: transfer.ParseFault(req.GetInjectFault()),
	}
	if src != nil {
		round.SrcMemory = src.Data
	}
	var st transfer.Stats
	if a.cfg.PaceRound0 > 0 && req.GetKind() == transfer.KindFull && round.Fault == transfer.NoFault {
		// The other data planes ignore Round.Pace: chunks of the round;
		// tcp_shm is paced frame by frame inside one send.
		send := sendPaced
		if name == transfer.TCPShm {
			send = sendStepPaced
		}
		var paced pacedRound
		paced, err = send(ctx, a.engineSteps, backend, round, a.cfg.PaceRound0)
		st = paced.Stats
		if err == nil {
			resp.PacedChunks, resp.SourceStepBeforeS, resp.SourceStepSlowestS = int32(paced.Chunks), paced.BaseStep.Seconds(), paced.MaxStep.Seconds()
			a.log.Info("round 0 paced by the source's steps", zap.String("migration_id", req.GetMigrationId()), zap.Int("chunks", paced.Chunks),
				zap.Int64("bytes", st.Bytes), zap.Duration("source_step_before", paced.BaseStep), zap.Duration("source_step_slowest", paced.MaxStep))
		}
	} else {
		st, err = backend.Send(ctx, round)
	}
	a.log.Debug("copy round", zap.String("kind", req.GetKind()), zap.String("backend", name), zap.Int("blocks", len(plan.Copies)),
		zap.Bool("inputs_in_one_op", in.oneOp), zap.Bool("inputs_from_pause", in.fromPause), zap.Duration("read", tRead.Sub(start)),
		zap.Duration("select", tSelect.Sub(tRead)), zap.Duration("send", time.Since(tSelect)))
	if err != nil {
		a.log.Warn("copy round failed", zap.String("migration_id", req.GetMigrationId()), zap.String("kind", req.GetKind()), zap.Error(err))
		return nil, errdefs.New(errdefs.ErrAborted, err.Error())
	}
	resp.Bytes = st.Bytes
	resp.DurationS = time.Since(start).Seconds()
	return resp, nil
}

// roundInputs are what a copy round reads from the source engine.
type roundInputs struct {
	Layout   hooks.Layout
	Requests hooks.RequestList
	Changes  hooks.Changes // since the round's cursor; empty for a full round
	oneOp    bool          // read in one step boundary of the engine core
	// fromPause: read with the pause before the round, by no op of its own.
	fromPause bool
}

// roundInputs reads the source's layout, its changes since since (with
// changes) and its request list: in one boundary of the engine core where
// its channel takes that, else one by one — the changes before the list,
// so that a block a step allocates and writes between the two reads is in
// the list and copied next round if not now (the other order could miss
// it for good).
func (a *Agent) roundInputs(ctx context.Context, withChanges bool, since uint64) (roundInputs, error) {
	var in roundInputs
	one, ok, err := a.eng.RoundInputs(ctx, since, withChanges)
	if ok {
		if err != nil {
			return in, err
		}
		in = roundInputs{Layout: one.Layout, Requests: one.Requests, oneOp: true, fromPause: one.FromPause}
		if one.Changes != nil {
			in.Changes = *one.Changes
		}
		return in, nil
	}
	if in.Layout, err = a.eng.KVLayout(ctx); err != nil {
		return in, err
	}
	if withChanges {
		if in.Changes, err = a.eng.Changes(ctx, since); err != nil {
			return in, err
		}
	}
	in.Requests, err = a.eng.Requests(ctx)
	return in, err
}

func movingFromProto(rbs []*v1.RequestBlocks) []transfer.Moving {
	out := make([]transfer.Moving, len(rbs))
	for i, rb := range rbs {
		out[i] = transfer.Moving{ID: rb.GetRequestId(), Src: ints(rb.GetSrcBlockIds()), Dst: ints(rb.GetDstBlockIds())}
	}
	return out
}

func ints(v []int32) []int {
	out := make([]int, len(v))
	for i, x := range v {
		out[i] = int(x)
	}
	return out
}

func int32s(v []int) []int32 {
	out := make([]int32, len(v))
	for i, x := range v {
		out[i] = int32(x)
	}
	return out
}

// pickBackend chooses the round's data plane (transfer.Pick) and, for
// cuda_ipc, checks that this agent can see both engines' GPUs: CUDA IPC
// opens memory only on a GPU the process sees, and an agent started under
// CUDA_VISIBLE_DEVICES may not see the peer's. Chosen by auto, the round
// then goes through tcp_shm (each agent stages its own engine's GPU);
// asked for, it is refused before anything moves.
func (a *Agent) pickBackend(src, dst hooks.Layout, peers transfer.RDMAPeers) (name, why string, err error) {
	name, why, err = transfer.Pick(a.cfg.TransferBackend, src, dst, peers)
	if err != nil || name != transfer.CUDAIPC {
		return name, why, err
	}
	if err := a.gpu.Sees(src, dst); err != nil {
		if transfer.Canonical(a.cfg.TransferBackend) == transfer.CUDAIPC {
			return "", "", fmt.Errorf("%w: cuda_ipc: %v", transfer.ErrUnsupported, err)
		}
		return transfer.TCPShm, fmt.Sprintf("auto: both engines' KV is in GPU memory on this node, but %v: staged through pinned host memory", err), nil
	}
	return name, why + a.gpuLink(src, dst), nil
}

// dataEnv is what this agent's data planes are built from.
func (a *Agent) dataEnv() dataplane.Env {
	return dataplane.Env{TLS: a.clientTLS, GPU: a.gpu, RDMA: a.rdma, RDMANote: a.rdmaNote}
}

// gpuLink names the link between the two engines' GPUs for a round's
// reason ("; GPU 0 → GPU 1: NVLink"), or "" when it is not known. The
// GPUs are found in NVML's inventory by the UUIDs the layouts give; a
// layout without them gives CUDA ordinals, which are NVML's indices only
// when CUDA_VISIBLE_DEVICES renumbers nothing (the process's own
// environment, inherited from the engine that started the agent).
func (a *Agent) gpuLink(src, dst hooks.Layout) string {
	if a.gpus == nil || len(src.Regions) == 0 || len(dst.Regions) == 0 {
		return ""
	}
	sm, dm := src.Regions[0].Memory, dst.Regions[0].Memory
	s, d := a.gpus.IndexOf(sm.DeviceUUID), a.gpus.IndexOf(dm.DeviceUUID)
	if s < 0 || d < 0 {
		if os.Getenv("CUDA_VISIBLE_DEVICES") != "" {
			return ""
		}
		s, d = sm.Device, dm.Device
	}
	if link := a.gpus.Link(s, d); link != "" {
		return fmt.Sprintf("; GPU %d → GPU %d: %s", s, d, link)
	}
	return ""
}

package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
	"github.com/vllm-hi/vllm-hi/internal/transfer/shm"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

func compatible(a, b kvlayout.Geometry) error {
	if a.Layers != b.Layers || a.KVHeads != b.KVHeads || a.HeadDim != b.HeadDim || a.DTypeBytes != b.DTypeBytes || a.BlockSize != b.BlockSize {
		return fmt.Errorf("source and target KV geometries differ: %d layers × %d heads × %d × %dB, block %d vs %d × %d × %d × %dB, block %d",
			a.Layers, a.KVHeads, a.HeadDim, a.DTypeBytes, a.BlockSize, b.Layers, b.KVHeads, b.HeadDim, b.DTypeBytes, b.BlockSize)
	}
	return nil
}

// CopyRound implements the Agent service: decide what to send, plan it
// against the target's layout and stream it.
func (s *agentService) CopyRound(ctx context.Context, req *v1.CopyRoundRequest) (*v1.CopyRoundResponse, error) {
	a := s.a
	start := time.Now()
	var dstLayout hooks.Layout
	if err := json.Unmarshal(req.GetTargetLayout(), &dstLayout); err != nil {
		return nil, errdefs.Newf(errdefs.ErrInvalidArgument, "target_layout: %v", err)
	}
	src, srcLayout, err := a.regions(ctx, false)
	if err != nil {
		return nil, err
	}
	geo := srcLayout.Geometry
	// An engine whose blocks are opaque (vLLM's CPU kernels tile the
	// slots inside a block) gets whole changed blocks instead of slots.
	slotGranular := req.GetSlotGranular() && !srcLayout.OpaqueBlocks && !dstLayout.OpaqueBlocks
	if err := compatible(geo, dstLayout.Geometry); err != nil {
		return nil, errdefs.New(errdefs.ErrConflict, err.Error())
	}
	bs := geo.BlockSize

	var cursor uint64
	var changes hooks.Changes
	// The changes first: a block a step allocates and writes between the
	// two reads is then in the request list, and copied next round if not
	// now. The other order could miss it for good.
	if req.GetKind() != "full" {
		if changes, err = a.eng.Changes(ctx, req.GetSinceCursor()); err != nil {
			return nil, err
		}
		cursor = changes.Cursor
	}
	tChanges := time.Now()
	list, err := a.eng.Requests(ctx)
	if err != nil {
		return nil, err
	}
	tRequests := time.Now()
	if req.GetKind() == "full" {
		cursor = list.Cursor
	}
	live := map[string]hooks.RequestInfo{}
	for _, r := range list.Requests {
		live[r.RequestID] = r
	}
	resp := &v1.CopyRoundResponse{Cursor: cursor}
	type target struct {
		table []int
		dst   []int32
	}
	moving := map[string]target{}
	for _, rb := range req.GetRequests() {
		info, ok := live[rb.GetRequestId()]
		dropped := !ok || info.Status != hooks.StatusRunning || len(info.BlockIDs) > len(rb.GetDstBlockIds())
		for i, b := range rb.GetSrcBlockIds() {
			if dropped || i >= len(info.BlockIDs) || info.BlockIDs[i] != int(b) {
				dropped = true // preempted: its blocks were freed and re-allocated
				break
			}
		}
		if dropped {
			resp.DroppedRequestIds = append(resp.DroppedRequestIds, rb.GetRequestId())
			continue
		}
		moving[info.RequestID] = target{table: info.BlockIDs, dst: rb.GetDstBlockIds()}
		cur := &v1.RequestBlocks{RequestId: info.RequestID, DstBlockIds: rb.GetDstBlockIds()}
		for _, b := range info.BlockIDs {
			cur.SrcBlockIds = append(cur.SrcBlockIds, int32(b))
		}
		resp.Requests = append(resp.Requests, cur)
	}
	var copies []kvlayout.BlockCopy
	if req.GetKind() == "full" {
		for id, t := range moving {
			used := (live[id].NumComputedTokens + bs - 1) / bs
			for i := 0; i < used && i < len(t.table); i++ {
				copies = append(copies, kvlayout.BlockCopy{Src: t.table[i], Dst: int(t.dst[i]), NumSlots: bs})
				resp.TokenSlots += int32(bs)
			}
		}
	} else {
		index := map[int]struct {
			id string
			i  int
		}{}
		for id, t := range moving {
			for i, b := range t.table {
				index[b] = struct {
					id string
					i  int
				}{id, i}
			}
		}
		for _, w := range changes.Written {
			at, ok := index[w.Block]
			if !ok || at.id != w.RequestID {
				continue
			}
			c := kvlayout.BlockCopy{Src: w.Block, Dst: int(moving[at.id].dst[at.i]), NumSlots: bs}
			if slotGranular {
				c.FirstSlot, c.NumSlots = w.FirstSlot, w.NumSlots
			}
			copies = append(copies, c)
			resp.TokenSlots += int32(c.NumSlots)
		}
	}
	// Copy in block order: consecutive blocks merge into longer runs.
	sortCopies(copies)
	resp.BlockCount = int32(len(copies))
	tSelect := time.Now()
	fault := tcpshm.NoFault
	switch req.GetInjectFault() {
	case "corrupt":
		fault = tcpshm.CorruptFrame
	case "cut":
		fault = tcpshm.CutConn
	case "silent_corrupt":
		fault = tcpshm.CorruptSilently
	}
	dest := tcpshm.Dest{Addr: req.GetTargetDataAddress(), Session: req.GetMigrationId(), Secret: req.GetSecret()}
	if req.GetTargetTls() {
		if a.clientTLS == nil {
			return nil, errdefs.New(errdefs.ErrConflict, "the target's data plane speaks TLS and this agent has no TLS configuration (--tls-ca-file)")
		}
		dest.TLS = a.clientTLS
	}
	tn := int(req.GetTn())
	if tn < 1 {
		tn = a.cfg.DefaultTN
	}
	var st tcpshm.Stats
	backend, err := a.pickBackend(srcLayout, dstLayout)
	if err != nil {
		return nil, errdefs.New(errdefs.ErrConflict, err.Error())
	}
	staged := onGPU(srcLayout) || onGPU(dstLayout) // tcp_shm with GPU KV on a side: runs, through pinned memory
	if backend == cudaipc.Type {
		st, err = a.cudaCopy(req.GetMigrationId(), srcLayout, dstLayout, copies, fault)
	} else if staged {
		st, err = a.sendStaged(ctx, dest, srcLayout, dstLayout, src, copies, tn, fault)
	} else if slotGranular {
		// Token slots: many tiny runs; send them as slot jobs the target
		// expands with its own layout.
		st, err = tcpshm.SendSlots(ctx, dest, tn, memory(src, srcLayout), copies, fault)
	} else {
		var runs []kvlayout.CopyRun
		if runs, err = kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(srcLayout), specs(dstLayout), copies); err != nil {
			return nil, errdefs.New(errdefs.ErrConflict, err.Error())
		}
		st, err = tcpshm.Send(ctx, dest, tn, src.Data, runs, fault)
	}
	a.log.Debug("copy round", zap.String("kind", req.GetKind()), zap.Int("blocks", len(copies)),
		zap.Duration("changes", tChanges.Sub(start)), zap.Duration("requests", tRequests.Sub(tChanges)),
		zap.Duration("select", tSelect.Sub(tRequests)), zap.Duration("send", time.Since(tSelect)))
	if err != nil {
		a.log.Warn("copy round failed", zap.String("migration_id", req.GetMigrationId()), zap.String("kind", req.GetKind()), zap.Error(err))
		return nil, errdefs.New(errdefs.ErrAborted, err.Error())
	}
	resp.Bytes = st.Bytes
	resp.DurationS = time.Since(start).Seconds()
	return resp, nil
}

func sortCopies(c []kvlayout.BlockCopy) {
	sort.Slice(c, func(i, j int) bool { return c[i].Src < c[j].Src })
}

// sendStaged sends a round over tcp_shm when a side's KV is in GPU
// memory: always as runs (a GPU target scatters runs, not slot jobs), the
// source's bytes gathered into pinned host memory first when it is the
// GPU side.
func (a *Agent) sendStaged(ctx context.Context, dest tcpshm.Dest, src, dst hooks.Layout, srcMem *shm.Regions, copies []kvlayout.BlockCopy, tn int, fault tcpshm.Fault) (tcpshm.Stats, error) {
	geo := src.Geometry
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(src), specs(dst), copies)
	if err != nil {
		return tcpshm.Stats{}, err
	}
	data := [][]byte(nil)
	if onGPU(src) {
		host, out, release, err := a.gatherGPU(src, runs)
		if err != nil {
			return tcpshm.Stats{}, err
		}
		defer release()
		data, runs = [][]byte{host}, out
	} else {
		data = srcMem.Data
	}
	return tcpshm.Send(ctx, dest, tn, data, runs, fault)
}

package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
	"github.com/vllm-hi/vllm-hi/internal/transfer/shm"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// dataPlane is the agent's side of KV transfer: its engine's regions mapped
// for reading (as a source) and writing (as a target), and the sessions it
// accepts KV for.
type dataPlane struct {
	mu        sync.Mutex
	src, dst  *shm.Regions
	dstLayout hooks.Layout
	sessions  map[string]bool
	server    *tcpshm.Server
}

// engineError translates an engine (hook) error into a gRPC status, once,
// at the boundary.
func engineError(err error) error {
	var he *engine.HTTPError
	if errors.As(err, &he) {
		code := codes.Unknown
		switch he.Status {
		case http.StatusBadRequest:
			code = codes.InvalidArgument
		case http.StatusNotFound:
			code = codes.NotFound
		case http.StatusConflict:
			code = codes.FailedPrecondition
		case http.StatusInsufficientStorage:
			code = codes.ResourceExhausted
		case http.StatusServiceUnavailable:
			code = codes.Unavailable
		}
		return status.Error(code, he.Message)
	}
	if err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	return nil
}

// hookRoutes maps hook names to the engine's HTTP method and path.
var hookRoutes = map[string]struct{ method, path string }{
	"layout":   {http.MethodGet, hooks.PathLayout},
	"requests": {http.MethodGet, hooks.PathRequests},
	"stats":    {http.MethodGet, hooks.PathStats},
	"changes":  {http.MethodGet, hooks.PathChanges},
	"pause":    {http.MethodPost, hooks.PathPause},
	"resume":   {http.MethodPost, hooks.PathResume},
	"export":   {http.MethodPost, hooks.PathExport},
	"allocate": {http.MethodPost, hooks.PathAllocate},
	"install":  {http.MethodPost, hooks.PathInstall},
	"abort":    {http.MethodPost, hooks.PathAbort},
}

// Hook forwards one hook call. The JSON bodies pass through as bytes: the
// final round's export and install carry every moved request's tokens,
// and decoding and re-encoding them here would sit inside the downtime.
func (s *agentService) Hook(ctx context.Context, req *v1.HookRequest) (*v1.HookResponse, error) {
	route, ok := hookRoutes[req.GetName()]
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument, "unknown hook %q", req.GetName())
	}
	path := route.path
	if req.GetName() == "changes" {
		path += "?since=" + strconv.FormatUint(req.GetSince(), 10)
	}
	body := req.GetBody()
	if route.method == http.MethodPost && len(body) == 0 {
		body = []byte("{}")
	}
	out, err := s.a.eng.Raw(ctx, route.method, path, body)
	if err != nil {
		return nil, engineError(err)
	}
	return &v1.HookResponse{Body: out}, nil
}

// regions returns the engine's regions mapped (re-mapping after the layout
// changed, e.g. across sleep and wake-up).
func (a *Agent) regions(ctx context.Context, writable bool) (*shm.Regions, hooks.Layout, error) {
	lay, err := a.eng.Layout(ctx)
	if err != nil {
		return nil, lay, err
	}
	dp := &a.dp
	dp.mu.Lock()
	defer dp.mu.Unlock()
	cur := &dp.src
	if writable {
		cur = &dp.dst
	}
	if onGPU(lay) {
		// GPU KV is mapped through IPC per migration (cudaCopy).
		if writable {
			dp.dstLayout = lay
		}
		return nil, lay, nil
	}
	if !(*cur).Same(lay) {
		(*cur).Close()
		r, err := shm.Map(lay, writable)
		if err != nil {
			*cur = nil
			return nil, lay, err
		}
		*cur = r
	}
	if writable {
		dp.dstLayout = lay
	}
	return *cur, lay, nil
}

// PrepareTarget implements the Agent service.
func (s *agentService) PrepareTarget(ctx context.Context, req *v1.PrepareTargetRequest) (*v1.PrepareTargetResponse, error) {
	a := s.a
	if req.GetMigrationId() == "" {
		return nil, status.Error(codes.InvalidArgument, "migration_id is required")
	}
	if a.dp.server == nil {
		return nil, status.Error(codes.FailedPrecondition, "this agent has no data plane")
	}
	_, lay, err := a.regions(ctx, true)
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "map target KV: %v", err)
	}
	a.dp.mu.Lock()
	a.dp.sessions[req.GetMigrationId()] = true
	a.dp.mu.Unlock()
	b, _ := json.Marshal(lay)
	return &v1.PrepareTargetResponse{Layout: b, DataAddress: a.dataAddr}, nil
}

// ReleaseTarget implements the Agent service.
func (s *agentService) ReleaseTarget(_ context.Context, req *v1.ReleaseTargetRequest) (*v1.ReleaseTargetResponse, error) {
	s.a.dp.mu.Lock()
	delete(s.a.dp.sessions, req.GetMigrationId())
	s.a.dp.mu.Unlock()
	s.a.gpu.release(req.GetMigrationId())
	return &v1.ReleaseTargetResponse{}, nil
}

// dataTarget resolves a session to the writable regions, refusing sessions
// the Host did not prepare.
func (a *Agent) dataTarget(session string) (*tcpshm.Memory, error) {
	a.dp.mu.Lock()
	defer a.dp.mu.Unlock()
	if !a.dp.sessions[session] {
		return nil, fmt.Errorf("no migration %q is expected here", session)
	}
	if onGPU(a.dp.dstLayout) {
		sink, err := a.gpu.sink(session, a.dp.dstLayout)
		if err != nil {
			return nil, err
		}
		return &tcpshm.Memory{Sink: sink}, nil
	}
	if a.dp.dst == nil {
		return nil, fmt.Errorf("target regions not mapped")
	}
	return memory(a.dp.dst, a.dp.dstLayout), nil
}

func memory(r *shm.Regions, l hooks.Layout) *tcpshm.Memory {
	return &tcpshm.Memory{Data: r.Data, Specs: specs(l), Layers: l.Geometry.Layers, Heads: l.Geometry.KVHeads,
		SlotBytes: int64(l.Geometry.HeadSlotBytes())}
}

func specs(l hooks.Layout) []kvlayout.RegionSpec {
	out := make([]kvlayout.RegionSpec, len(l.Regions))
	for i, r := range l.Regions {
		out[i] = kvlayout.RegionSpec{FirstLayer: r.FirstLayer, NumLayers: r.NumLayers, FirstHead: r.FirstHead, NumHeads: r.NumHeads,
			Strides: kvlayout.Strides{Layer: r.LayerStride, KV: r.KVStride, Block: r.BlockStride, Head: r.HeadStride, Slot: r.SlotStride}}
	}
	return out
}

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
		return nil, status.Errorf(codes.InvalidArgument, "target_layout: %v", err)
	}
	src, srcLayout, err := a.regions(ctx, false)
	if err != nil {
		return nil, engineError(err)
	}
	geo := srcLayout.Geometry
	// An engine whose blocks are opaque (vLLM's CPU kernels tile the
	// slots inside a block) gets whole changed blocks instead of slots.
	slotGranular := req.GetSlotGranular() && !srcLayout.OpaqueBlocks && !dstLayout.OpaqueBlocks
	if err := compatible(geo, dstLayout.Geometry); err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	bs := geo.BlockSize

	var cursor uint64
	var changes hooks.Changes
	// The changes first: a block a step allocates and writes between the
	// two reads is then in the request list, and copied next round if not
	// now. The other order could miss it for good.
	if req.GetKind() != "full" {
		if changes, err = a.eng.Changes(ctx, req.GetSinceCursor()); err != nil {
			return nil, engineError(err)
		}
		cursor = changes.Cursor
	}
	tChanges := time.Now()
	list, err := a.eng.Requests(ctx)
	if err != nil {
		return nil, engineError(err)
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
	}
	tn := int(req.GetTn())
	if tn < 1 {
		tn = a.cfg.DefaultTN
	}
	var st tcpshm.Stats
	backend, err := a.pickBackend(srcLayout, dstLayout)
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	staged := onGPU(srcLayout) || onGPU(dstLayout) // tcp_shm with GPU KV on a side: runs, through pinned memory
	if backend == cudaipc.Type {
		st, err = a.cudaCopy(req.GetMigrationId(), req.GetKind() == "final", srcLayout, dstLayout, copies, fault)
	} else if staged {
		st, err = a.sendStaged(ctx, req, srcLayout, dstLayout, src, copies, tn, fault)
	} else if slotGranular {
		// Token slots: many tiny runs; send them as slot jobs the target
		// expands with its own layout.
		st, err = tcpshm.SendSlots(ctx, req.GetTargetDataAddress(), req.GetMigrationId(), tn, memory(src, srcLayout), copies, fault)
	} else {
		var runs []kvlayout.CopyRun
		if runs, err = kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(srcLayout), specs(dstLayout), copies); err != nil {
			return nil, status.Error(codes.FailedPrecondition, err.Error())
		}
		st, err = tcpshm.Send(ctx, req.GetTargetDataAddress(), req.GetMigrationId(), tn, src.Data, runs, fault)
	}
	a.log.Debug("copy round", zap.String("kind", req.GetKind()), zap.Int("blocks", len(copies)),
		zap.Duration("changes", tChanges.Sub(start)), zap.Duration("requests", tRequests.Sub(tChanges)),
		zap.Duration("select", tSelect.Sub(tRequests)), zap.Duration("send", time.Since(tSelect)))
	if err != nil {
		a.log.Warn("copy round failed", zap.String("migration_id", req.GetMigrationId()), zap.String("kind", req.GetKind()), zap.Error(err))
		return nil, status.Error(codes.Aborted, err.Error())
	}
	resp.Bytes = st.Bytes
	resp.DurationS = time.Since(start).Seconds()
	return resp, nil
}

func sortCopies(c []kvlayout.BlockCopy) {
	sort.Slice(c, func(i, j int) bool { return c[i].Src < c[j].Src })
}

// Retire implements the Agent service.
func (s *agentService) Retire(context.Context, *v1.RetireRequest) (*v1.RetireResponse, error) {
	a := s.a
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
		defer cancel()
		if err := a.eng.Sleep(ctx, 1, "wait"); err != nil {
			a.log.Warn("retire: could not put the engine to sleep", zap.Error(err))
			return
		}
		a.log.Info("retired: the engine's KV is released")
	}()
	return &v1.RetireResponse{}, nil
}

// sendStaged sends a round over tcp_shm when a side's KV is in GPU
// memory: always as runs (a GPU target scatters runs, not slot jobs), the
// source's bytes gathered into pinned host memory first when it is the
// GPU side.
func (a *Agent) sendStaged(ctx context.Context, req *v1.CopyRoundRequest, src, dst hooks.Layout, srcMem *shm.Regions, copies []kvlayout.BlockCopy, tn int, fault tcpshm.Fault) (tcpshm.Stats, error) {
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
	return tcpshm.Send(ctx, req.GetTargetDataAddress(), req.GetMigrationId(), tn, data, runs, fault)
}

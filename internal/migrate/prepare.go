package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sort"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// prepare: select requests on the source, reserve blocks on the target
// for each request's whole remaining life, and ready the target's data
// plane to take exactly those blocks from a source holding the
// migration's secret.
func (m *migration) prepare() error {
	ctx, cancel := context.WithDeadline(context.Background(), m.deadline)
	defer cancel()
	m.step(stepReserve)
	var err error
	if m.srcA, err = m.o.agents.Get(m.src.AgentAddress, m.src.TLS); err != nil {
		return err
	}
	if m.dstA, err = m.o.agents.Get(m.dst.AgentAddress, m.dst.TLS); err != nil {
		return err
	}
	cctx, ccancel := m.call(ctx)
	defer ccancel()
	if m.srcLayout, err = m.srcA.Engine.Layout(cctx); err != nil {
		return fmt.Errorf("read the source's layout: %w", err)
	}
	dl, err := m.dstA.Engine.Layout(cctx)
	if err != nil {
		return fmt.Errorf("read the target's layout: %w", err)
	}
	if sp, dp := m.srcLayout.Parallel, dl.Parallel; (m.srcLayout.OpaqueBlocks || dl.OpaqueBlocks) && sp != dp {
		// Opaque blocks are copied whole between engines of one shape; a
		// reshape would need where each head's bytes are, which such a
		// layout does not say (a plan would move bytes the check then
		// reads back the same wrong way).
		return refuse(errdefs.ErrConflict, "%s runs tp %d pp %d and %s tp %d pp %d, and an engine's KV blocks are opaque "+
			"(vLLM's CPU kernels lay a block out as a whole): a shape change cannot map them; migrate between engines of one shape",
			m.src.ID, sp.TP, sp.PP, m.dst.ID, dp.TP, dp.PP)
	}
	list, err := m.srcA.Engine.Requests(cctx)
	if err != nil {
		return fmt.Errorf("list the source's requests: %w", err)
	}
	var candidates []Candidate
	var elsewhere []string
	byID := map[string]hooks.RequestInfo{}
	now := time.Now()
	for _, r := range list.Requests {
		// Only running streams a Host relays can be spliced; the rest
		// (non-streaming requests, clients talking to the engine directly,
		// waiting requests, and those whose state does not move: see
		// hooks.RequestInfo.Unmovable) finish where they are.
		if r.Status != hooks.StatusRunning || !r.Stream || r.Paused || r.Unmovable != "" {
			continue
		}
		if s := m.o.streams.Get(r.RequestID); s != nil {
			candidates = append(candidates, Candidate{RequestInfo: r, Model: s.Model, Tag: s.Tag, AgeS: now.Sub(s.Started).Seconds()})
		} else {
			elsewhere = append(elsewhere, r.RequestID)
			byID[r.RequestID] = r
		}
	}
	// Those the other Hosts of a shared store relay.
	candidates = append(candidates, m.remoteCandidates(cctx, elsewhere, byID)...)
	selected, err := m.filter.Select(candidates)
	if err != nil {
		return refuse(errdefs.ErrInvalidArgument, "%v", err)
	}
	items := m.needs(selected)
	var blocks []int32
	if len(items) > 0 {
		ids := make([]string, len(items))
		for i, it := range items {
			ids[i] = it.RequestID
		}
		m.releaseWarmCopies(cctx, ids)
		alloc, err := m.reserve(cctx, items)
		if err != nil {
			return err
		}
		if n := sharedOnTarget(items, alloc); n > 0 {
			m.log.Info("the target shares the moving requests' shared prompt prefixes: each of their blocks moves once",
				zap.Int("blocks_shared", n))
		}
		m.mu.Lock() // the recorder reads reserved
		for _, a := range alloc.Requests {
			m.reserved[a.RequestID] = true
		}
		m.mu.Unlock()
		for _, a := range alloc.Requests {
			if a.Recompute {
				// State only: no blocks to copy into, none to verify.
				m.recompute[a.RequestID] = true
				m.moving[a.RequestID] = &v1.RequestBlocks{RequestId: a.RequestID}
				continue
			}
			rb := &v1.RequestBlocks{RequestId: a.RequestID}
			for _, b := range a.BlockIDs {
				rb.DstBlockIds = append(rb.DstBlockIds, int32(b))
				blocks = append(blocks, int32(b))
			}
			m.moving[a.RequestID] = rb
		}
		// A block the target shares between requests is in several tables.
		slices.Sort(blocks)
		blocks = slices.Compact(blocks)
		m.mu.Lock()
		m.st.Recomputed = slices.Sorted(maps.Keys(m.recompute))
		m.mu.Unlock()
	}
	m.step(stepPrepare)
	// The target takes this migration's KV only until its reservation is
	// about to end: a stalled migration cannot write into blocks the
	// engine freed and handed to someone else.
	lease := time.Until(m.deadline)
	pt, err := m.dstA.RPC.PrepareTarget(cctx, &v1.PrepareTargetRequest{MigrationId: m.st.ID, Secret: m.secret, BlockIds: blocks,
		LeaseMs: lease.Milliseconds()})
	if err != nil {
		return fmt.Errorf("prepare the target: %w", err)
	}
	m.dstLayout, m.dataAddr, m.dstRDMA = pt.GetLayout(), pt.GetDataAddress(), pt.GetRdma()
	var dstLayout hooks.Layout
	if err := json.Unmarshal(m.dstLayout, &dstLayout); err != nil {
		return fmt.Errorf("the target's layout: %w", err)
	}
	m.dstOpaque = dstLayout.OpaqueBlocks
	m.dstOnGPU = transfer.OnGPU(dstLayout)
	m.dstStages = dstLayout.StagesState
	if dstLayout.Geometry.BlockSize != m.srcLayout.Geometry.BlockSize {
		return refuse(errdefs.ErrConflict, "the engines' block sizes differ (%d, %d)", m.srcLayout.Geometry.BlockSize, dstLayout.Geometry.BlockSize)
	}
	m.mu.Lock()
	m.st.Requests = len(items)
	m.mu.Unlock()
	return nil
}

// reserve reserves the items' blocks on the target. When the target
// cannot hold them all, the requests whose KV fits (the longest first: the
// most to recompute otherwise) keep theirs and the rest move as state
// only, for the target to recompute, as it would after preempting them:
// a scale-in onto a smaller engine neither stalls nor is refused. An
// engine that cannot recompute (its allocate hook refuses the item) gets
// the refusal it always got.
func (m *migration) reserve(ctx context.Context, items []hooks.AllocateItem) (hooks.AllocateResponse, error) {
	lease := int(m.o.cfg.ReservationLease / time.Millisecond)
	injected := m.req.InjectFault == "target_full" // a test of the recompute path on any target
	var alloc hooks.AllocateResponse
	err := errdefs.Newf(errdefs.ErrResourceExhausted, "injected: the target has no free block")
	if !injected {
		alloc, err = m.dstA.Engine.Allocate(ctx, hooks.AllocateRequest{Requests: items, LeaseMS: lease})
		if err == nil {
			return alloc, nil
		}
	}
	if !errdefs.IsResourceExhausted(err) {
		return alloc, fmt.Errorf("reserve blocks on the target: %w", err)
	}
	full := refuse(errdefs.ErrConflict, "target %s cannot hold the KV of %d requests: %v", m.dst.ID, len(items), err)
	list, lerr := m.dstA.Engine.Requests(ctx)
	if lerr != nil {
		return alloc, full
	}
	if injected {
		list.FreeBlocks = 0
	}
	bs := m.dst.Engine.Geometry.BlockSize
	for _, it := range items {
		if (it.NumTokens+bs-1)/bs > list.TotalBlocks {
			// It could never run there, recomputed or not.
			return alloc, refuse(errdefs.ErrConflict, "target %s cannot hold request %s at all (%d tokens, %d blocks of %d in all)",
				m.dst.ID, it.RequestID, it.NumTokens, list.TotalBlocks, bs)
		}
	}
	// Shared prefixes are left out of the second try: a request that
	// recomputes holds no blocks to share, and counting every block
	// keeps the fit simple and safe.
	for i := range items {
		items[i].SharedPrefix = nil
	}
	split := fitByBlocks(items, list.FreeBlocks, bs)
	alloc, err = m.dstA.Engine.Allocate(ctx, hooks.AllocateRequest{Requests: split, LeaseMS: lease})
	if err != nil {
		return alloc, full
	}
	asked := map[string]bool{}
	for _, it := range split {
		asked[it.RequestID] = it.Recompute
	}
	for _, a := range alloc.Requests {
		if want, ok := asked[a.RequestID]; !ok || a.Recompute != want || (a.Recompute && len(a.BlockIDs) > 0) {
			// An engine that did not take a recompute item as one (it held
			// blocks for it, or ignored the field): installing state alone
			// there would run on KV that never came. Refuse instead.
			m.releaseReservations(ctx, alloc)
			return hooks.AllocateResponse{}, refuse(errdefs.ErrConflict, "target %s cannot hold the KV of %d requests and did not take request %s as a recompute reservation",
				m.dst.ID, len(items), a.RequestID)
		}
	}
	n := countRecompute(split)
	m.log.Info("the target holds the KV of some requests only: the rest move as state and recompute there",
		zap.Int("kv", len(split)-n), zap.Int("recompute", n))
	return alloc, nil
}

// fitByBlocks marks as recompute every item past what free blocks hold,
// keeping the KV of the longest requests; the order of items is kept.
func fitByBlocks(items []hooks.AllocateItem, free, blockSize int) []hooks.AllocateItem {
	order := make([]int, len(items))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return items[order[a]].NumTokens > items[order[b]].NumTokens })
	out := append([]hooks.AllocateItem(nil), items...)
	for _, i := range order {
		need := (items[i].NumTokens + blockSize - 1) / blockSize
		if need <= free {
			free -= need
			continue
		}
		out[i].Recompute = true
	}
	return out
}

func countRecompute(items []hooks.AllocateItem) int {
	n := 0
	for _, it := range items {
		if it.Recompute {
			n++
		}
	}
	return n
}

// releaseReservations aborts reservations made on the target.
func (m *migration) releaseReservations(ctx context.Context, alloc hooks.AllocateResponse) {
	var ids []string
	for _, a := range alloc.Requests {
		ids = append(ids, a.RequestID)
	}
	if len(ids) > 0 {
		_, _ = m.dstA.Engine.Abort(ctx, hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true})
	}
}

// needs is what each selected request reserves on the target: blocks for
// its whole remaining life (its max_tokens, within the target's context),
// the first of them shared with an earlier request's where the source's
// prefix cache shares them (sharedPrefixes).
func (m *migration) needs(selected []Candidate) []hooks.AllocateItem {
	shared := sharedPrefixes(selected, m.src.Engine.Geometry.BlockSize)
	g := m.dst.Engine.Geometry
	maxLen := g.BlockSize * (g.NumBlocks - 1)
	if m.dst.Engine.MaxModelLen > 0 {
		maxLen = m.dst.Engine.MaxModelLen
	}
	items := make([]hooks.AllocateItem, 0, len(selected))
	for _, r := range selected {
		need := min(r.NumPromptTokens+max(r.MaxTokens, r.NumOutputTokens+1), maxLen)
		it := hooks.AllocateItem{RequestID: r.RequestID, NumTokens: max(need, r.NumPromptTokens+r.NumOutputTokens+1)}
		if sp, ok := shared[r.RequestID]; ok {
			it.SharedPrefix = &sp
		}
		items = append(items, it)
	}
	return items
}

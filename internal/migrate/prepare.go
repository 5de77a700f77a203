package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
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
	list, err := m.srcA.Engine.Requests(cctx)
	if err != nil {
		return fmt.Errorf("list the source's requests: %w", err)
	}
	var candidates []Candidate
	now := time.Now()
	for _, r := range list.Requests {
		// Only running streams this Host relays can be spliced; the rest
		// (non-streaming requests, clients talking to the engine directly,
		// waiting requests) finish where they are.
		if r.Status != hooks.StatusRunning || !r.Stream || r.Paused {
			continue
		}
		if s := m.o.streams.Get(r.RequestID); s != nil {
			candidates = append(candidates, Candidate{RequestInfo: r, Model: s.Model, Tag: s.Tag, AgeS: now.Sub(s.Started).Seconds()})
		}
	}
	selected, err := m.filter.Select(candidates)
	if err != nil {
		return refuse(errdefs.ErrInvalidArgument, "%v", err)
	}
	items := m.needs(selected)
	var blocks []int32
	if len(items) > 0 {
		alloc, err := m.dstA.Engine.Allocate(cctx, hooks.AllocateRequest{Requests: items, LeaseMS: int(m.o.cfg.ReservationLease / time.Millisecond)})
		if err != nil {
			if errdefs.IsResourceExhausted(err) {
				return refuse(errdefs.ErrConflict, "target %s cannot hold the KV of %d requests: %v", m.dst.ID, len(items), err)
			}
			return fmt.Errorf("reserve blocks on the target: %w", err)
		}
		for _, a := range alloc.Requests {
			m.reserved[a.RequestID] = true
			rb := &v1.RequestBlocks{RequestId: a.RequestID}
			for _, b := range a.BlockIDs {
				rb.DstBlockIds = append(rb.DstBlockIds, int32(b))
				blocks = append(blocks, int32(b))
			}
			m.moving[a.RequestID] = rb
		}
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
	m.dstLayout, m.dataAddr = pt.GetLayout(), pt.GetDataAddress()
	var dstLayout hooks.Layout
	if err := json.Unmarshal(m.dstLayout, &dstLayout); err != nil {
		return fmt.Errorf("the target's layout: %w", err)
	}
	m.dstOpaque = dstLayout.OpaqueBlocks
	if dstLayout.Geometry.BlockSize != m.srcLayout.Geometry.BlockSize {
		return refuse(errdefs.ErrConflict, "the engines' block sizes differ (%d, %d)", m.srcLayout.Geometry.BlockSize, dstLayout.Geometry.BlockSize)
	}
	m.mu.Lock()
	m.st.Requests = len(items)
	m.mu.Unlock()
	return nil
}

// needs is what each selected request reserves on the target: blocks for
// its whole remaining life (its max_tokens, within the target's context).
func (m *migration) needs(selected []Candidate) []hooks.AllocateItem {
	g := m.dst.Engine.Geometry
	maxLen := g.BlockSize * (g.NumBlocks - 1)
	if m.dst.Engine.MaxModelLen > 0 {
		maxLen = m.dst.Engine.MaxModelLen
	}
	items := make([]hooks.AllocateItem, 0, len(selected))
	for _, r := range selected {
		need := min(r.NumPromptTokens+max(r.MaxTokens, r.NumOutputTokens+1), maxLen)
		items = append(items, hooks.AllocateItem{RequestID: r.RequestID, NumTokens: max(need, r.NumPromptTokens+r.NumOutputTokens+1)})
	}
	return items
}

package transfer

import (
	"sort"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// Round kinds.
const (
	KindFull        = "full"
	KindIncremental = "incremental"
	KindFinal       = "final"
)

// Moving is one request a migration moves: its source block table as the
// last round saw it (empty before the first) and the target blocks
// reserved for it.
type Moving struct {
	ID  string
	Src []int
	Dst []int
}

// Plan is what one round sends.
type Plan struct {
	// Copies are sorted by source block, so that neighbours merge into
	// longer runs.
	Copies     []kvlayout.BlockCopy
	TokenSlots int
	// Dropped requests leave the migration: gone from the source, no
	// longer running, grown beyond their reservation, or preempted (their
	// blocks were freed and re-allocated since the last round).
	Dropped []string
	// Moving are the requests that stay, with their current source tables.
	Moving []Moving
}

// PlanRound decides what a round copies. A full round copies every block
// a moving request has computed tokens in; the other rounds copy what the
// source wrote since the last round's cursor (written), whole blocks or,
// with slotGranular, just the token slots written.
//
// A source block several moving requests hold (a prompt prefix their
// engine's prefix cache shares) goes once to each distinct target block
// they map it to: once when the target shares it too (hooks.SharedPrefix),
// once per holder when it does not.
func PlanRound(kind string, moving []Moving, live []hooks.RequestInfo, written []hooks.BlockWrite, blockSize int, slotGranular bool) Plan {
	var p Plan
	byID := make(map[string]hooks.RequestInfo, len(live))
	for _, r := range live {
		byID[r.RequestID] = r
	}
	type pair struct{ src, dst int }
	// Every target block a source block goes to this round, in order.
	targets := map[int][]int{}
	seen := map[pair]bool{}
	var order []int // source blocks in the order first met
	add := func(src, dst int) {
		if seen[pair{src, dst}] {
			return
		}
		seen[pair{src, dst}] = true
		if _, ok := targets[src]; !ok {
			order = append(order, src)
		}
		targets[src] = append(targets[src], dst)
	}
	for _, mv := range moving {
		info, ok := byID[mv.ID]
		if !ok || info.Status != hooks.StatusRunning || len(info.BlockIDs) > len(mv.Dst) || !extends(info.BlockIDs, mv.Src) {
			p.Dropped = append(p.Dropped, mv.ID)
			continue
		}
		p.Moving = append(p.Moving, Moving{ID: mv.ID, Src: append([]int(nil), info.BlockIDs...), Dst: mv.Dst})
		used := len(info.BlockIDs)
		if kind == KindFull {
			used = min(used, (info.NumComputedTokens+blockSize-1)/blockSize)
		}
		for i := 0; i < used; i++ {
			add(info.BlockIDs[i], mv.Dst[i])
		}
	}
	if kind == KindFull {
		for _, b := range order {
			for _, d := range targets[b] {
				p.Copies = append(p.Copies, kvlayout.BlockCopy{Src: b, Dst: d, NumSlots: blockSize})
				p.TokenSlots += blockSize
			}
		}
	} else {
		// A write is copied wherever a moving request holds its block,
		// whichever request the engine says wrote it (a shared block's
		// writer may be a request that is not moving).
		for _, w := range written {
			for _, d := range targets[w.Block] {
				c := kvlayout.BlockCopy{Src: w.Block, Dst: d, NumSlots: blockSize}
				if slotGranular {
					c.FirstSlot, c.NumSlots = w.FirstSlot, w.NumSlots
				}
				p.Copies = append(p.Copies, c)
				p.TokenSlots += c.NumSlots
			}
		}
	}
	sort.SliceStable(p.Copies, func(i, j int) bool { return p.Copies[i].Src < p.Copies[j].Src })
	return p
}

// extends reports whether table begins with prev: the request kept the
// blocks the last round saw (a preempted request's were freed).
func extends(table, prev []int) bool {
	if len(prev) > len(table) {
		return false
	}
	for i, b := range prev {
		if table[i] != b {
			return false
		}
	}
	return true
}

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
func PlanRound(kind string, moving []Moving, live []hooks.RequestInfo, written []hooks.BlockWrite, blockSize int, slotGranular bool) Plan {
	var p Plan
	byID := make(map[string]hooks.RequestInfo, len(live))
	for _, r := range live {
		byID[r.RequestID] = r
	}
	type at struct {
		request string
		index   int
	}
	owner := map[int]at{} // source block → its request and place in the table
	dst := map[string][]int{}
	for _, mv := range moving {
		info, ok := byID[mv.ID]
		if !ok || info.Status != hooks.StatusRunning || len(info.BlockIDs) > len(mv.Dst) || !extends(info.BlockIDs, mv.Src) {
			p.Dropped = append(p.Dropped, mv.ID)
			continue
		}
		p.Moving = append(p.Moving, Moving{ID: mv.ID, Src: append([]int(nil), info.BlockIDs...), Dst: mv.Dst})
		dst[mv.ID] = mv.Dst
		if kind == KindFull {
			used := (info.NumComputedTokens + blockSize - 1) / blockSize
			for i := 0; i < used && i < len(info.BlockIDs); i++ {
				p.Copies = append(p.Copies, kvlayout.BlockCopy{Src: info.BlockIDs[i], Dst: mv.Dst[i], NumSlots: blockSize})
				p.TokenSlots += blockSize
			}
			continue
		}
		for i, b := range info.BlockIDs {
			owner[b] = at{mv.ID, i}
		}
	}
	if kind != KindFull {
		for _, w := range written {
			o, ok := owner[w.Block]
			if !ok || o.request != w.RequestID {
				continue
			}
			c := kvlayout.BlockCopy{Src: w.Block, Dst: dst[o.request][o.index], NumSlots: blockSize}
			if slotGranular {
				c.FirstSlot, c.NumSlots = w.FirstSlot, w.NumSlots
			}
			p.Copies = append(p.Copies, c)
			p.TokenSlots += c.NumSlots
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

package migrate

import (
	"context"
	"fmt"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// Round kinds.
const (
	roundFull        = "full"
	roundIncremental = "incremental"
	roundFinal       = "final"
)

// copyRounds runs the full round and then incremental rounds while the
// source decodes, until they stop shrinking, and returns the cursor the
// last one copied up to.
func (m *migration) copyRounds(ctx context.Context) (uint64, error) {
	if err := m.enter(ctx, stepRound0); err != nil {
		return 0, err
	}
	start := time.Now()
	before := proxy.P99(m.movingGaps(start.Add(-gapsBefore), start))
	r0, err := m.copyRound(ctx, roundFull, 0, false, "")
	if err != nil {
		return 0, err
	}
	m.noteRound0Gaps(start, before)
	since := r0.GetCursor()
	if err := m.enter(ctx, stepIncremental); err != nil {
		return 0, err
	}
	best, stall := -1, 0
	for round := 1; round <= m.o.cfg.MaxIncrRounds; round++ {
		r, err := m.copyRound(ctx, roundIncremental, since, false, "")
		if err != nil {
			return 0, err
		}
		since = r.GetCursor()
		if !shrinking(int(r.GetBlockCount()), &best, &stall, m.o.cfg.StallRounds) {
			break
		}
	}
	return since, nil
}

// shrinking is the rounds' convergence rule: go on while a round copies
// more than one block and the best round so far improved within the last
// stallRounds rounds.
func shrinking(blocks int, best, stall *int, stallRounds int) bool {
	if blocks <= 1 {
		return false
	}
	if *best < 0 || blocks < *best {
		*best, *stall = blocks, 0
		return true
	}
	*stall++
	return *stall < stallRounds
}

// copyRound runs one round on the source agent and records it.
func (m *migration) copyRound(ctx context.Context, kind string, since uint64, slotGranular bool, fault string) (*v1.CopyRoundResponse, error) {
	m.mu.Lock()
	reqs := make([]*v1.RequestBlocks, 0, len(m.moving))
	for id, rb := range m.moving {
		if !m.recompute[id] { // no KV of theirs moves
			reqs = append(reqs, rb)
		}
	}
	m.mu.Unlock()
	if len(reqs) == 0 {
		// Every moving request recomputes on the target: nothing to copy.
		m.mu.Lock()
		m.st.Rounds = append(m.st.Rounds, hostapi.Round{Round: len(m.st.Rounds), Kind: kind})
		m.mu.Unlock()
		return &v1.CopyRoundResponse{}, nil
	}
	resp, err := m.srcA.RPC.CopyRound(ctx, &v1.CopyRoundRequest{
		MigrationId: m.st.ID, Kind: kind, SinceCursor: since, Requests: reqs,
		TargetDataAddress: m.dataAddr, TargetLayout: m.dstLayout, Tn: int32(m.req.TN),
		SlotGranular: slotGranular, InjectFault: fault, Secret: m.secret, TargetTls: m.dst.TLS, TargetRdma: m.dstRDMA,
	})
	if err != nil {
		if ctx.Err() != nil {
			return nil, m.interrupted(ctx, kind+" copy round")
		}
		return nil, fmt.Errorf("%s copy round: %w", kind, err)
	}
	m.drop(resp.GetDroppedRequestIds()...)
	m.mu.Lock()
	for _, rb := range resp.GetRequests() {
		if cur, ok := m.moving[rb.GetRequestId()]; ok {
			cur.SrcBlockIds = rb.GetSrcBlockIds()
		}
	}
	if b := resp.GetBackend(); b != "" {
		m.st.TransferBackend, m.st.TransferBackendReason = b, resp.GetBackendReason()
	}
	r := hostapi.Round{Round: len(m.st.Rounds), Kind: kind, BlockCount: int(resp.GetBlockCount()),
		TokenSlots: int(resp.GetTokenSlots()), Bytes: resp.GetBytes(), DurationS: resp.GetDurationS(),
		PacedChunks: int(resp.GetPacedChunks()), SourceStepBeforeS: resp.GetSourceStepBeforeS(), SourceStepSlowestS: resp.GetSourceStepSlowestS()}
	if kind == roundFull {
		r.SharedBlocks = sharedBlocks(resp.GetRequests())
		if once := copiesOnce(resp.GetRequests()); once > 0 && r.BlockCount > 0 {
			// A full round sends whole blocks: each the same bytes.
			r.SharedBytesSaved = int64(once) * (r.Bytes / int64(r.BlockCount))
		}
	}
	m.st.Rounds = append(m.st.Rounds, r)
	m.st.Bytes += r.Bytes
	m.mu.Unlock()
	return resp, nil
}

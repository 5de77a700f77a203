package migrate

import (
	"context"
	"errors"
	"fmt"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"time"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// run is the migration after prepare. Everything up to the commit runs
// under the migration's deadline: a stalled agent or engine aborts it
// rather than holding both instances (and, later, the source's pause).
func (m *migration) run() {
	ctx, cancel := context.WithDeadline(m.o.ctx, m.deadline)
	defer cancel()
	m.step(stepRound0)
	r0, err := m.copyRound(ctx, "full", 0, false, "")
	if err != nil {
		m.fail(err)
		return
	}
	since := r0.GetCursor()

	// Incremental rounds until the seed's convergence rules say stop.
	m.step(stepIncremental)
	best, stall := -1, 0
	for round := 1; round <= m.o.cfg.MaxIncrRounds; round++ {
		r, err := m.copyRound(ctx, "incremental", since, false, "")
		if err != nil {
			m.fail(err)
			return
		}
		since = r.GetCursor()
		n := int(r.GetBlockCount())
		if n <= 1 {
			break
		}
		if best < 0 || n < best {
			best, stall = n, 0
		} else if stall++; stall >= m.o.cfg.StallRounds {
			break
		}
	}
	// The check of what is on the target already, while A decodes (a
	// second round and pass to shrink what the pause checks measured no
	// better on an H200: the round in between lets A decode as much again).
	if m.o.cfg.Verify != hostapi.VerifyOff {
		m.step(stepCopyCheck)
	}
	if err := m.verifyCopied(ctx, since); err != nil {
		m.o.met.integrity(err)
		m.fail(err)
		return
	}
	m.final(ctx, since)
}

// copyRound runs one round on the source agent and records it.
func (m *migration) copyRound(ctx context.Context, kind string, since uint64, slotGranular bool, fault string) (*v1.CopyRoundResponse, error) {
	m.mu.Lock()
	reqs := make([]*v1.RequestBlocks, 0, len(m.moving))
	for _, rb := range m.moving {
		reqs = append(reqs, rb)
	}
	m.mu.Unlock()
	resp, err := m.srcA.CopyRound(ctx, &v1.CopyRoundRequest{
		MigrationId: m.st.ID, Kind: kind, SinceCursor: since, Requests: reqs,
		TargetDataAddress: m.dataAddr, TargetLayout: m.dstLayout, Tn: int32(m.req.TN),
		SlotGranular: slotGranular, InjectFault: fault, Secret: m.secret, TargetTls: m.dst.TLS,
	})
	if err != nil {
		switch {
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			return nil, fmt.Errorf("%s copy round: the migration's deadline passed (%v after it started)", kind, m.deadline.Sub(m.st.CreatedAt).Round(time.Millisecond))
		case ctx.Err() != nil:
			return nil, fmt.Errorf("%s copy round: the Host is shutting down", kind)
		}
		return nil, fmt.Errorf("%s copy round: %w", kind, rpcError(err))
	}
	m.drop(resp.GetDroppedRequestIds()...)
	m.mu.Lock()
	for _, rb := range resp.GetRequests() {
		if cur, ok := m.moving[rb.GetRequestId()]; ok {
			cur.SrcBlockIds = rb.GetSrcBlockIds()
		}
	}
	m.st.Rounds = append(m.st.Rounds, hostapi.Round{Round: len(m.st.Rounds), Kind: kind, BlockCount: int(resp.GetBlockCount()),
		TokenSlots: int(resp.GetTokenSlots()), Bytes: resp.GetBytes(), DurationS: resp.GetDurationS()})
	m.mu.Unlock()
	return resp, nil
}

package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// stageState hands a target that prepares installs ahead (hooks.Layout
// StagesState: vLLM, whose detokenizer replays every moved output token)
// a snapshot of the moving requests, exported from the running source in
// chunks side by side, so that inside the pause only the tokens generated
// since are replayed. It is an optimisation: a failure is logged and the
// install does the whole work. The channel closes when it is done (nil:
// nothing to stage).
func (m *migration) stageState(ctx context.Context) <-chan struct{} {
	return m.stage(ctx, false)
}

// topUpStage stages again, just before the pause, what the source
// generated since the first stage (which ran beside the check of the
// copied KV, seconds at full load): a tokens-only snapshot, which the
// vLLM plugin's engine core answers over its core channel, so that the
// install inside the pause replays a few tokens per request, not
// seconds' worth. Like staging, an optimisation: a failure is logged.
func (m *migration) topUpStage(ctx context.Context) {
	if done := m.stage(ctx, true); done != nil {
		<-done
	}
}

// roundAfterStage copies, before the pause, what the source wrote while
// the Host waited for the stage and its top-up after the check (waited):
// without it the final round carried all of that inside the pause — at
// the seed's cut load on an H100 the check and the stages took 0.4 s
// after the last round, and the final round moved 669–743 blocks, 7.5–14 %
// of round 0 (2026-12-06). It runs when the wait outlasted CatchUpRatio ×
// the last copy round (CatchUpRounds 0: never), like the check's catch-up,
// and returns the cursor the final round copies from. The pause's check
// covers what it copies: every token after the boundary the check before
// the pause drew.
func (m *migration) roundAfterStage(ctx context.Context, since uint64, waited time.Duration) (uint64, error) {
	if m.o.cfg.CatchUpRounds == 0 || waited <= time.Duration(m.o.cfg.CatchUpRatio*float64(m.lastRound())) {
		return since, nil
	}
	if err := ctx.Err(); err != nil {
		return since, m.interrupted(ctx, "copy round after the stage")
	}
	r, err := m.copyRound(ctx, roundIncremental, since, false, "")
	if err != nil {
		return since, fmt.Errorf("copy round after the stage: %w", err)
	}
	m.log.Debug("copied what the source wrote during the stage", zap.Duration("waited", waited), zap.Int32("blocks", r.GetBlockCount()))
	return r.GetCursor(), nil
}

// stage exports snapshots of the moving requests from the source in chunks
// side by side and stages them on the target (tokensOnly: a top-up).
func (m *migration) stage(ctx context.Context, tokensOnly bool) <-chan struct{} {
	ids := m.ids()
	if !m.dstStages || len(ids) == 0 {
		return nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		start := time.Now()
		chunks := stateChunks(ids)
		counts := make([]int, len(chunks))
		errs := make([]error, len(chunks))
		sideBySide(len(chunks), func(i int) { counts[i], errs[i] = m.stageChunk(ctx, chunks[i], tokensOnly) })
		staged, failed := 0, errors.Join(errs...)
		for _, k := range counts {
			staged += k
		}
		if !tokensOnly {
			m.mu.Lock()
			m.st.Staged = staged
			m.mu.Unlock()
		}
		if failed != nil {
			m.log.Warn("staging the requests' state on the target failed; the install does it in the pause",
				zap.Bool("top_up", tokensOnly), zap.Error(failed))
		}
		m.log.Debug("staged the requests' state on the target", zap.Int("requests", len(ids)), zap.Int("staged", staged),
			zap.Bool("top_up", tokensOnly), zap.Duration("took", time.Since(start)))
	}()
	return done
}

// stageChunk exports a snapshot of some running requests and stages it
// on the target; it returns how many the target staged.
func (m *migration) stageChunk(ctx context.Context, ids []string, tokensOnly bool) (int, error) {
	cctx, cancel := m.call(ctx)
	defer cancel()
	b, _ := json.Marshal(hooks.ExportRequest{RequestIDs: ids, Snapshot: true, TokensOnly: tokensOnly})
	raw, err := m.srcA.Engine.Raw(cctx, hooks.HookExport, b)
	if err != nil {
		return 0, err
	}
	var exp struct {
		Requests json.RawMessage `json:"requests"`
	}
	if err := json.Unmarshal(raw, &exp); err != nil || len(exp.Requests) == 0 {
		return 0, err
	}
	out, err := m.dstA.Engine.Raw(cctx, hooks.HookStage, append(append([]byte(`{"requests":`), exp.Requests...), '}'))
	var st hooks.StageResponse
	if err == nil {
		err = json.Unmarshal(out, &st)
	}
	// A stage that failed may have dropped an earlier one: nothing staged
	// then (the install in the pause gets their whole states).
	m.recordStaged(exp.Requests, st.Staged)
	if err != nil {
		return 0, err
	}
	return len(st.Staged), nil
}

// recordStaged notes how many output tokens the target's stage of each
// request it staged holds (states: the snapshot it staged from); a request
// of the snapshot that the target did not stage (wholly: the vLLM plugin
// names those both its halves took) has no stage the Host can count on.
func (m *migration) recordStaged(states json.RawMessage, staged []string) {
	var snap []struct {
		RequestID      string        `json:"request_id"`
		OutputTokenIDs hooks.IntList `json:"output_token_ids"`
	}
	if json.Unmarshal(states, &snap) != nil {
		m.mu.Lock()
		m.staged = nil // which of them the target holds is not known
		m.mu.Unlock()
		return
	}
	took := make(map[string]bool, len(staged))
	for _, id := range staged {
		took[id] = true
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.staged == nil {
		m.staged = map[string]int{}
	}
	for _, r := range snap {
		if took[r.RequestID] {
			m.staged[r.RequestID] = len(r.OutputTokenIDs)
		} else {
			delete(m.staged, r.RequestID)
		}
	}
}

// stagedOutputs is the export's OutputFrom for ids: how many output tokens
// the target's stage of each holds (nil: none staged).
func (m *migration) stagedOutputs(ids []string) map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.staged) == 0 {
		return nil
	}
	out := make(map[string]int, len(ids))
	for _, id := range ids {
		if n, ok := m.staged[id]; ok {
			out[id] = n
		}
	}
	return out
}

package migrate

import (
	"context"
	"encoding/json"
	"errors"
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
	if err != nil {
		return 0, err
	}
	var st hooks.StageResponse
	if err := json.Unmarshal(out, &st); err != nil {
		return 0, err
	}
	return len(st.Staged), nil
}

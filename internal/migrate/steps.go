package migrate

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// step is a phase of a migration as its status names it.
type step string

// The steps, in the protocol's order.
const (
	stepReserve     step = "reserve"
	stepPrepare     step = "prepare_target"
	stepRound0      step = "round_0"
	stepIncremental step = "incremental_rounds"
	stepCopyCheck   step = "verify_copied"
	stepPause       step = "pause_source"
	stepFinal       step = "final_round"
	stepVerify      step = "verify"
	stepCommit      step = "install_target"
	stepSwitch      step = "switch"
	stepApply       step = "apply_type"
	stepRollback    step = "rollback"
	stepDone        step = "done"
)

// enter starts step s, ending the one before, unless ctx — the migration's
// deadline, or the Host stopping — is done: then it says which.
func (m *migration) enter(ctx context.Context, s step) error {
	if err := ctx.Err(); err != nil {
		return m.interrupted(ctx, string(s))
	}
	m.step(s)
	return nil
}

// interrupted is the error of work that ctx stopped.
func (m *migration) interrupted(ctx context.Context, what string) error {
	switch {
	case m.o.ctx.Err() != nil:
		return fmt.Errorf("%s: the Host is shutting down", what)
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("%s: the migration's deadline passed (%v after it started)", what, m.deadline.Sub(m.st.CreatedAt).Round(time.Millisecond))
	}
	return fmt.Errorf("%s: cancelled", what)
}

// step records that step s started, ending the one before.
func (m *migration) step(s step) {
	m.mu.Lock()
	now := time.Now().UTC()
	m.endStepLocked(now)
	m.st.CurrentStep = string(s)
	m.st.StepHistory = append(m.st.StepHistory, hostapi.Step{Step: string(s), StartedAt: now})
	m.traceStep(s, now)
	m.mu.Unlock()
	m.o.rec.save(m.st.ID)
}

func (m *migration) endStepLocked(now time.Time) { endStep(&m.st, now) }

// endStep ends a status's last step at now, unless it ended already.
func endStep(st *hostapi.MigrationStatus, now time.Time) {
	if n := len(st.StepHistory); n > 0 && st.StepHistory[n-1].EndedAt.IsZero() {
		h := &st.StepHistory[n-1]
		h.EndedAt = now
		h.DurationS = now.Sub(h.StartedAt).Seconds()
	}
}

package agent

import (
	"context"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// defaultRetireWait is how long a retiring engine's remaining requests may
// run before the agent gives up releasing its KV.
const defaultRetireWait = 10 * time.Minute

// Retire implements the Agent service: the engine's retire hook waits for
// the requests still on it — running and waiting alike: they arrived
// before the switch and must finish here — and then releases its KV, or
// says why it cannot.
func (s *agentService) Retire(ctx context.Context, req *v1.RetireRequest) (*v1.RetireResponse, error) {
	a := s.a
	wait := time.Duration(req.GetWaitMs()) * time.Millisecond
	if wait <= 0 {
		wait = defaultRetireWait
	}
	// The hook call itself may last the whole wait, plus the release.
	rctx, cancel := context.WithTimeout(ctx, wait+30*time.Second)
	defer cancel()
	out, err := a.eng.Retire(rctx, hooks.RetireRequest{WaitS: wait.Seconds()})
	if err != nil {
		a.log.Warn("retire: the engine did not release its KV", zap.Error(err))
		return nil, err
	}
	if out.Released {
		// Mappings of the old KV must not outlive it.
		a.dp.mu.Lock()
		a.dp.src.Close()
		a.dp.dst.Close()
		a.dp.src, a.dp.dst = nil, nil
		a.dp.mu.Unlock()
		a.log.Info("retired: the engine's KV is released", zap.Int64("bytes", out.ReleasedBytes))
	} else {
		a.log.Warn("retired, but the engine kept its KV", zap.String("note", out.Note))
	}
	a.mu.Lock()
	a.retired = true
	a.mu.Unlock()
	return &v1.RetireResponse{Released: out.Released, ReleasedBytes: out.ReleasedBytes, Note: out.Note}, nil
}

// Wake implements the Agent service.
func (s *agentService) Wake(ctx context.Context, _ *v1.WakeRequest) (*v1.WakeResponse, error) {
	a := s.a
	out, err := a.eng.Wake(ctx)
	if err != nil {
		return nil, err
	}
	a.mu.Lock()
	a.retired = false
	a.mu.Unlock()
	a.log.Info("woken: the engine's KV is back", zap.String("note", out.Note))
	return &v1.WakeResponse{Note: out.Note}, nil
}

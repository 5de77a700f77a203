package engine

import (
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// A final copy round's inputs read with the pause (hooks.PauseRequest's
// RoundSince): the engine core answers them at the boundary where the
// pause took hold, and the agent keeps them for the final round that
// follows, instead of sending a `round` op that would queue on the
// engine's loop behind the pause's exports (H100, 2026-12-06: 16 of the
// op's 31 ms were that wait, inside the clients' gap).

// pausedRoundTTL bounds how long kept inputs stay usable: a final round
// comes right after its pause, well within any pause lease.
const pausedRoundTTL = 30 * time.Second

// pausedRound is a final round's inputs as the pause's answer carried
// them, still encoded (decoded when the round takes them, outside the
// pause call's own time).
type pausedRound struct {
	since uint64
	raw   json.RawMessage
	at    time.Time
}

// pausedRounds holds the inputs of the source's last pause, if any.
type pausedRounds struct {
	mu   sync.Mutex
	last *pausedRound
}

// keep records the inputs a pause since cursor since answered.
func (p *pausedRounds) keep(since uint64, raw json.RawMessage) {
	p.mu.Lock()
	p.last = &pausedRound{since: since, raw: raw, at: time.Now()}
	p.mu.Unlock()
}

// forget drops kept inputs: a resume makes them stale.
func (p *pausedRounds) forget() {
	p.mu.Lock()
	p.last = nil
	p.mu.Unlock()
}

// take returns, once, the inputs kept for a round since cursor since.
func (p *pausedRounds) take(since uint64) (json.RawMessage, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	last := p.last
	if last == nil || last.since != since || time.Since(last.at) > pausedRoundTTL {
		return nil, false
	}
	p.last = nil
	return last.raw, true
}

// pauseAnswer is the core channel's answer to a pause with RoundSince.
type pauseAnswer struct {
	hooks.PauseResponse
	Round json.RawMessage `json:"round,omitempty"`
}

// notePause keeps the round inputs a pause's answer carries (asked for by
// req) and returns the answer without them — the Host needs none of it —
// with the engine core's own wait for the step boundary.
func (c *Client) notePause(req hooks.PauseRequest, out json.RawMessage, wait time.Duration) (hooks.PauseResponse, error) {
	var a pauseAnswer
	if err := json.Unmarshal(out, &a); err != nil {
		return a.PauseResponse, fmt.Errorf("engine core pause: decode: %w", err)
	}
	if req.RoundSince != nil && len(a.Round) > 0 {
		c.paused.keep(*req.RoundSince, a.Round)
	}
	a.StepWaitS = wait.Seconds()
	return a.PauseResponse, nil
}

// takePausedRound decodes the inputs kept from the last pause for a
// round since cursor since, if there are any.
func (c *Client) takePausedRound(since uint64) (RoundInputs, bool, error) {
	var in RoundInputs
	raw, ok := c.paused.take(since)
	if !ok {
		return in, false, nil
	}
	if err := json.Unmarshal(raw, &in); err != nil {
		return in, true, fmt.Errorf("engine core pause: the round's inputs: %w", err)
	}
	if in.Changes == nil {
		return in, true, fmt.Errorf("engine core pause: no changes in the round's inputs")
	}
	in.FromPause = true
	return in, true, nil
}

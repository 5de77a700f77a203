package sim

import (
	"net/http"
)

// Holding a request's last tokens is a test control, not a vLLM feature:
// a test that asserts a migration or a drain moves every stream needs the
// streams alive until the operation has moved them, whatever the
// machine's speed. A request with at most HoldTail output tokens left is
// not scheduled while the hold is on: it keeps its blocks and its seat,
// its stream stays open, and it finishes once the hold is lifted or once
// it runs on an engine that does not hold (the migration's target). What
// it generates does not change: the tokens it would have drawn are drawn
// later, from the same KV.

// HoldTail makes the engine keep every request that has at most n output
// tokens left from decoding further; n = 0 lifts the hold.
func (e *Engine) HoldTail(n int) {
	e.lock()
	e.holdTail = max(n, 0)
	e.mu.Unlock()
	e.signal()
}

// heldAtTail reports whether the hold keeps r from its next step. A
// request still prefilling its prompt is never held.
func (e *Engine) heldAtTail(r *request) bool {
	if e.holdTail == 0 || r.numComputed < len(r.prompt) {
		return false
	}
	left := min(r.params.MaxTokens, e.cfg.MaxModelLen-len(r.prompt)) - len(r.output)
	return left <= e.holdTail
}

// holdRequest is the body of POST /vhi_sim/hold_tail.
type holdRequest struct {
	Tokens *int `json:"tokens"`
}

// holdTail serves POST /vhi_sim/hold_tail {"tokens": n}.
func (s *Server) holdTail(w http.ResponseWriter, r *http.Request) {
	var body holdRequest
	if err := decodeBody(r, &body); err != nil {
		writeError(w, err)
		return
	}
	if body.Tokens == nil || *body.Tokens < 0 {
		writeError(w, badRequest("tokens", "tokens must be given and at least 0"))
		return
	}
	s.eng.HoldTail(*body.Tokens)
	writeJSON(w, http.StatusOK, map[string]int{"tokens": *body.Tokens})
}

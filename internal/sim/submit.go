package sim

import (
	"context"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// NewRequest is a validated generation request.
type NewRequest struct {
	ID       string
	Prompt   []int
	Params   hooks.SamplingParams
	Meta     hooks.ResponseMeta
	Priority int
	// SeedSet says the client gave a seed; otherwise one is derived from the
	// engine seed and the prompt so the same request is reproducible on any
	// instance (and the derived seed travels with a migration).
	SeedSet bool
}

// Submit validates and queues a request.
func (e *Engine) Submit(nr NewRequest) error {
	if len(nr.Prompt) == 0 {
		return badRequest("prompt", "The prompt cannot be empty.")
	}
	if nr.Params.MaxTokens < 1 {
		return badRequest("max_tokens", "max_tokens must be at least 1, got %d.", nr.Params.MaxTokens)
	}
	if len(nr.Prompt)+nr.Params.MaxTokens > e.cfg.MaxModelLen {
		return badRequest("max_tokens",
			"This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			e.cfg.MaxModelLen, len(nr.Prompt)+nr.Params.MaxTokens, len(nr.Prompt), nr.Params.MaxTokens)
	}
	if !nr.SeedSet {
		nr.Params.Seed = e.derivedSeed(nr.Prompt)
	}
	now := time.Now()
	r := &request{
		id: nr.ID, prompt: nr.Prompt, params: nr.Params, meta: nr.Meta,
		arrival: now, priority: nr.Priority, state: stateWaiting,
		blockHashes: e.promptBlockHashes(nr.Prompt),
	}
	e.lock()
	if e.sleeping || e.kv == nil {
		// As vLLM's sleep mode answers the routes that need the model: at
		// once, with the reason, never a request left waiting.
		e.mu.Unlock()
		return unavailable("The model is sleeping: its KV cache is released (POST /wake_up, or vhi wake for an engine a migration retired, brings it back).")
	}
	if _, dup := e.requests[r.id]; dup {
		e.mu.Unlock()
		return badRequest("request_id", "Request id %s is already running.", r.id)
	}
	e.requests[r.id] = r
	r.publish()
	e.watchable.Store(r.id, r)
	e.waiting = append(e.waiting, r)
	e.met.promptTokens.Add(float64(len(r.prompt)))
	e.mu.Unlock()
	e.signal()
	return nil
}

func (e *Engine) derivedSeed(prompt []int) int64 {
	x := uint64(e.cfg.Seed) ^ 0x51_7C_C1_B7_27_22_0A_95
	for _, t := range prompt {
		x = mix64(x ^ uint64(t))
	}
	return int64(x >> 1)
}

// Output is a consistent view of a request's output from one index on.
type Output struct {
	Tokens      []int  // output tokens from index From
	TextOffsets []int  // visible text length after each of them
	TextBefore  int    // visible text length before token From
	Text        string // the whole visible output text
	From        int
	Finished    bool
	Silent      bool
	Reason      string
	StopReason  any
	NumPrompt   int
	NumOutput   int
	Meta        hooks.ResponseMeta
}

// Watcher follows one request's published output.
type Watcher struct{ r *request }

// Watcher returns a watcher of request id, or a not-found error for unknown
// (or long-finished) ids. It does not wait for a step.
func (e *Engine) Watcher(id string) (*Watcher, error) {
	r, ok := e.watchable.Load(id)
	if !ok {
		return nil, notFound("request_id", "Request %s does not exist.", id)
	}
	return &Watcher{r: r.(*request)}, nil
}

// AwaitInstalled waits (up to wait) until a migration installs request id
// here, and returns its watcher and the output index it was installed at:
// a stream pre-attached before the install starts there.
func (e *Engine) AwaitInstalled(ctx context.Context, id string, wait time.Duration) (*Watcher, int, error) {
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		e.lock()
		r, sig := e.requests[id], e.installs
		installed := r != nil && r.installed
		from := 0
		if installed {
			from = r.installedFrom
		}
		e.mu.Unlock()
		if installed {
			return &Watcher{r: r}, from, nil
		}
		select {
		case <-sig:
		case <-t.C:
			return nil, 0, notFound("request_id", "Request %s was not installed here within %v.", id, wait)
		case <-ctx.Done():
			return nil, 0, ctx.Err()
		}
	}
}

// Next returns the output from token index from, waiting until there is
// something new, the request finishes or ctx ends.
func (w *Watcher) Next(ctx context.Context, from int) (Output, error) {
	v := &w.r.pub
	for {
		v.mu.Lock()
		// From beyond what exists waits for it (a stream recovered from an
		// older snapshot skips what the engine regenerates first).
		if from < len(v.output) || v.finished {
			from = min(from, len(v.output))
			o := Output{
				Tokens:      append([]int(nil), v.output[from:]...),
				TextOffsets: append([]int(nil), v.textOffsets[from:]...),
				Text:        v.text,
				From:        from,
				Finished:    v.finished,
				Silent:      v.silent,
				Reason:      v.reason,
				StopReason:  v.stopReason,
				NumPrompt:   v.numPrompt,
				NumOutput:   len(v.output),
				Meta:        v.meta,
			}
			if from > 0 && from <= len(v.textOffsets) {
				o.TextBefore = v.textOffsets[from-1]
			}
			v.mu.Unlock()
			return o, nil
		}
		ch := v.changed()
		v.mu.Unlock()
		select {
		case <-ctx.Done():
			return Output{}, ctx.Err()
		case <-ch:
		}
	}
}

// Watch returns request id's output from token index from (see Next).
func (e *Engine) Watch(ctx context.Context, id string, from int) (Output, error) {
	w, err := e.Watcher(id)
	if err != nil {
		return Output{}, err
	}
	return w.Next(ctx, from)
}

// AbortClient aborts a request whose client went away. Unknown ids are
// ignored: the request may have finished or moved.
func (e *Engine) AbortClient(id string) {
	e.lock()
	defer e.mu.Unlock()
	if r := e.requests[id]; r != nil && r.state != stateReserved {
		e.finish(r, "abort", nil, time.Now())
		e.cursor++
	}
}

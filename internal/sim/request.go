package sim

import (
	"strings"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

type reqState int

const (
	stateWaiting  reqState = iota // queued, or preempted and waiting to recompute
	stateRunning                  // in the running batch
	stateReserved                 // blocks allocated by the install hook, not yet installed
	stateFinished
)

// request is one sequence inside the engine. Every field is guarded by the
// engine's mutex.
type request struct {
	id     string
	prompt []int
	output []int
	// text is the detokenized output (truncated at a stop string);
	// textOffsets[i] is how much of it is visible after output token i.
	text        string
	textOffsets []int
	numComputed int // tokens whose KV is in the blocks
	blocks      []int
	// inFlight: the step in flight computes this request; dropStep: a
	// pause dropped that step's work for it (inflight.go).
	inFlight, dropStep bool
	// blockHashes are the prompt's full blocks' hashes with the prefix
	// cache (prefixcache.go), nil without.
	blockHashes []uint64
	params      hooks.SamplingParams
	meta        hooks.ResponseMeta
	arrival     time.Time
	priority    int
	state       reqState
	preempted   bool

	paused        bool
	pauseDeadline time.Time // zero: no lease (vLLM's own /pause)
	// uncommitted: installed paused on a migration target and not resumed
	// yet; its lease ending drops it (the source still runs it).
	uncommitted  bool
	reserveUntil time.Time
	// recompute: reserved without blocks; installed, it waits like a
	// preempted request and recomputes its KV from its tokens.
	recompute bool
	// installed: by a migration (Install), at output index installedFrom
	// — where a pre-attached stream starts.
	installed     bool
	installedFrom int

	finishReason string // "length", "stop", "abort"
	stopReason   any    // nil, a stop string, or a stop token id
	silent       bool   // aborted by a hook: end the stream without a finish chunk

	numPreemptions int
	scheduledAt    time.Time
	firstTokenAt   time.Time
	lastTokenAt    time.Time
	finishedAt     time.Time

	// pub is what the request's readers (client streams, attach) see.
	pub view
}

// view is a request's output as last published (at each token and at its
// end), under its own lock: client streams follow it without the engine's
// lock, which a step holds for its whole compute — 256 attached streams
// queueing on it after every step stretched a migration's switch by
// hundreds of milliseconds.
type view struct {
	mu sync.Mutex
	// output and textOffsets share the request's backing arrays: their
	// published elements are never rewritten (releaseText copies).
	output, textOffsets []int
	text                string
	finished, silent    bool
	reason              string
	stopReason          any
	numPrompt           int
	meta                hooks.ResponseMeta
	notify              chan struct{} // closed and replaced at each publish
}

// changed returns the channel the next publish closes (v.mu held).
func (v *view) changed() chan struct{} {
	if v.notify == nil {
		v.notify = make(chan struct{})
	}
	return v.notify
}

func (r *request) numTokens() int { return len(r.prompt) + len(r.output) }

// token returns the id at absolute position pos.
func (r *request) token(pos int) int {
	if pos < len(r.prompt) {
		return r.prompt[pos]
	}
	return r.output[pos-len(r.prompt)]
}

func (r *request) finished() bool { return r.state == stateFinished }

func (r *request) maxStopLen() int {
	n := 0
	for _, s := range r.params.Stop {
		n = max(n, len(s))
	}
	return n
}

// appendText adds the piece of a new token, applies stop strings and
// records the visible text length. It reports whether a stop string hit.
func (r *request) appendText(piece string) (hit string, ok bool) {
	old := len(r.text)
	r.text += piece
	if ms := r.maxStopLen(); ms > 0 {
		from := max(0, old-ms+1)
		best := -1
		for _, s := range r.params.Stop {
			if s == "" {
				continue
			}
			if i := strings.Index(r.text[from:], s); i >= 0 && (best < 0 || from+i < best) {
				best, hit = from+i, s
			}
		}
		if best >= 0 {
			r.text = r.text[:best]
			r.textOffsets = append(r.textOffsets, len(r.text))
			return hit, true
		}
	}
	visible := len(r.text)
	if ms := r.maxStopLen(); ms > 1 {
		// Hold back a tail that could still become a stop string, as vLLM's
		// detokenizer does.
		visible = max(0, visible-(ms-1))
	}
	if n := len(r.textOffsets); n > 0 && visible < r.textOffsets[n-1] {
		visible = r.textOffsets[n-1]
	}
	r.textOffsets = append(r.textOffsets, visible)
	return "", false
}

// release makes the whole text visible once the request is done.
func (r *request) releaseText() {
	if n := len(r.textOffsets); n > 0 {
		// A copy: readers may hold the published slice.
		offs := append([]int(nil), r.textOffsets...)
		offs[n-1] = len(r.text)
		r.textOffsets = offs
	}
}

// publish makes r's current output visible to its readers (e.mu held).
func (r *request) publish() {
	v := &r.pub
	v.mu.Lock()
	v.output, v.textOffsets, v.text = r.output, r.textOffsets, r.text
	v.finished, v.silent, v.reason, v.stopReason = r.finished(), r.silent, r.finishReason, r.stopReason
	v.numPrompt, v.meta = len(r.prompt), r.meta
	close(v.changed())
	v.notify = make(chan struct{})
	v.mu.Unlock()
}

func (r *request) info() hooks.RequestInfo {
	st := hooks.StatusRunning
	switch {
	case r.state == stateWaiting && r.preempted:
		st = hooks.StatusPreempted
	case r.state == stateWaiting:
		st = hooks.StatusWaiting
	}
	return hooks.RequestInfo{
		RequestID: r.id, Status: st, Paused: r.paused,
		NumPromptTokens: len(r.prompt), NumOutputTokens: len(r.output),
		NumComputedTokens: r.numComputed, BlockIDs: append([]int(nil), r.blocks...),
		ArrivalTime: unixSeconds(r.arrival),
		Stream:      r.meta.Stream, MaxTokens: r.params.MaxTokens,
	}
}

func (r *request) exportState() hooks.RequestState {
	return hooks.RequestState{
		RequestID:         r.id,
		PromptTokenIDs:    append([]int(nil), r.prompt...),
		OutputTokenIDs:    append([]int(nil), r.output...),
		NumComputedTokens: r.numComputed,
		Sampling:          r.params,
		RNGPosition:       len(r.output),
		OutputText:        r.text,
		TextOffsets:       append([]int(nil), r.textOffsets...),
		ArrivalTime:       unixSeconds(r.arrival),
		Priority:          r.priority,
		BlockIDs:          append([]int(nil), r.blocks...),
		Response:          r.meta,
	}
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

func fromUnixSeconds(s float64) time.Time { return time.Unix(0, int64(s*1e9)) }

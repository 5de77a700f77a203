// Package sim is vhi sim: a vLLM stand-in with real paged KV memory whose
// next token is computed from KV bytes read back from that memory, so a
// migration that loses or alters one byte changes the output.
package sim

import (
	"context"
	"fmt"
	"math"
	"math/bits"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/cespare/xxhash/v2"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/tokenizer"
)

// Engine is the continuous-batching engine. One goroutine (Run) steps it;
// HTTP handlers and hooks call in under mu. A step is scheduled and
// committed under mu, and its compute (the KV it writes, the hashes its
// tokens come from) runs between with a step in flight (inFlight), as
// vLLM's forward pass runs beside its scheduler: lock() waits for the
// boundary, so whoever takes it sees the engine between steps; only the
// calls that read what a step does not change until it commits (the write
// log, the request list, stats, the export of paused requests) and a pause
// that drops the step's work take mu during the compute (inflight.go).
type Engine struct {
	cfg  Config
	geo  kvlayout.Geometry
	par  kvlayout.Parallel
	tok  *tokenizer.Tokenizer
	log  *zap.Logger
	met  *engineMetrics
	wake chan struct{}

	cuda *cuda.Lib // loaded when the KV lives on a GPU

	failpointFired atomic.Bool

	mu sync.Mutex
	// boundary (on mu) is broadcast when a step's KV writes have landed
	// and when it commits; inFlight and writesLanded say where it is.
	boundary               sync.Cond
	inFlight, writesLanded bool
	boundaryWaiters        int       // callers waiting for the boundary (inflight.go)
	kv                     *kvMemory // nil while sleeping
	kvGen                  uint64    // bumped each time the KV memory is (re-)created
	pool                   *blockPool
	requests               map[string]*request // live and reserved requests
	done                   map[string]*request // finished, kept for attach until retention ends
	// watchable indexes the submitted and installed requests of both maps
	// for Watcher, which must not wait for e.mu: a step holds it for its
	// whole compute, and a migration attaches hundreds of streams at once.
	watchable sync.Map // id → *request
	// installs is closed (and replaced) by every Install: what a
	// pre-attach waits on.
	installs chan struct{}
	waiting  []*request
	running  []*request
	cursor   uint64 // generation of the last completed mutation
	steps    uint64

	pausedAll  bool // vLLM /pause?mode=keep: nothing is scheduled
	pausedNew  bool // vLLM /pause?mode=wait|abort: no new request is admitted
	sleeping   bool // the KV or the weights are asleep: nothing is scheduled
	sleepLevel int
	// weightsAsleep: /sleep put the weights to sleep; weightsStale: they
	// were woken after a level-2 sleep and not reloaded, so every token
	// drawn is wrong (sleep.go).
	weightsAsleep, weightsStale bool
	scaling                     atomic.Bool // read without mu by the HTTP middleware
	scaleMu                     sync.Mutex  // one elastic-EP scale at a time
	dpSize                      int
	elasticPaused               bool             // an elastic-EP commit: nothing advances
	lastScale                   [2]time.Duration // the last scale's prepare and commit
	lastStep                    time.Duration    // modelled duration of the last step
	lastCompute                 time.Duration    // real compute time of the last step
	// holdTail: requests with at most this many output tokens left are
	// not scheduled (a test control, hold.go); 0: none held.
	holdTail int
}

// NewEngine validates cfg, creates the KV memory and returns an engine
// ready to Run. Close releases the KV files.
func NewEngine(cfg Config, log *zap.Logger) (*Engine, error) {
	if err := checkFailpoint(cfg.Failpoint); err != nil {
		return nil, err
	}
	geo, par, err := cfg.geometry()
	if err != nil {
		return nil, err
	}
	var drv *cuda.Lib
	if gpu, _, _ := cfg.devices(); gpu {
		if drv, err = cuda.Load(); err != nil {
			return nil, fmt.Errorf("--device %s: %w", cfg.Device, err)
		}
	}
	kv, err := newKV(cfg, drv, geo, par)
	if err != nil {
		if drv != nil {
			drv.Close()
		}
		return nil, err
	}
	e := &Engine{
		cuda: drv,
		cfg:  cfg, geo: geo, par: par, tok: tokenizer.New(), log: log,
		wake:     make(chan struct{}, 1),
		installs: make(chan struct{}),
		kv:       kv,
		kvGen:    1,
		requests: map[string]*request{},
		done:     map[string]*request{},
		dpSize:   max(cfg.DataParallelSize, 1),
	}
	e.boundary.L = &e.mu
	e.pool = e.newPool()
	e.met = newEngineMetrics(e)
	return e, nil
}

// newPool is an empty block pool, with a prefix cache where configured.
func (e *Engine) newPool() *blockPool {
	p := newBlockPool(e.geo.NumBlocks, e.geo.BlockSize)
	if e.cfg.EnablePrefixCaching {
		p.enableCache()
	}
	return p
}

// Config returns the validated configuration.
func (e *Engine) Config() Config { return e.cfg }

// Geometry returns the KV geometry.
func (e *Engine) Geometry() kvlayout.Geometry { return e.geo }

// Tokenizer returns the engine's tokenizer.
func (e *Engine) Tokenizer() *tokenizer.Tokenizer { return e.tok }

// Close removes the KV memory. Call it after Run has returned.
func (e *Engine) Close() {
	e.lock()
	defer e.mu.Unlock()
	if e.kv != nil {
		e.kv.close()
		e.kv = nil
	}
	if e.cuda != nil {
		e.cuda.Close()
		e.cuda = nil
	}
}

// newKV creates the KV memory where cfg.Device says.
func newKV(cfg Config, drv *cuda.Lib, geo kvlayout.Geometry, par kvlayout.Parallel) (*kvMemory, error) {
	if gpu, devs, _ := cfg.devices(); gpu {
		return newGPUKVMemory(drv, devs, geo, par, cfg.KVLayout == "NHD", cfg.MaxNumSeqs, cfg.MaxNumBatchedTokens)
	}
	return newKVMemory(geo, par, cfg.KVLayout == "NHD", cfg.ShmDir, cfg.ShmPrefix)
}

func (e *Engine) signal() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Generations: a mutation (a step, an abort, a lease expiry) stamps what it
// writes and frees with e.cursor+1 and then advances e.cursor, all under mu,
// so a reader that sees cursor X has seen every change stamped ≤ X (and,
// while a step is in flight, maybe its schedule's frees, stamped X+1: a
// reader asking again since X sees them again).

// Run steps the engine until ctx ends.
func (e *Engine) Run(ctx context.Context) {
	idle := time.NewTimer(time.Hour)
	defer idle.Stop()
	for {
		e.mu.Lock()
		e.waitersServed()
		now := time.Now()
		e.expireLeases(now)
		var st *stepWork
		if !e.sleeping && e.kv != nil {
			st = e.beginStep(now)
		}
		e.mu.Unlock()
		stepped := st != nil
		var model time.Duration
		if stepped {
			model = e.runStep(st, now)
		}

		if stepped {
			// Fill the modelled step time; the real work above is small.
			if rest := model - time.Since(now); rest > 0 {
				idle.Reset(rest)
				select {
				case <-ctx.Done():
					return
				case <-idle.C:
				}
			} else if ctx.Err() != nil {
				return
			}
			continue
		}
		// Nothing to do: wait for work, or for a lease to expire.
		idle.Reset(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			return
		case <-e.wake:
		case <-idle.C:
		}
	}
}

// work is one request's share of a step.
type work struct {
	r      *request
	tokens int
}

// step schedules, computes and commits one step with mu held (tests and
// benchmarks; Run releases mu for the compute). It reports whether
// anything ran and the modelled duration.
func (e *Engine) step(now time.Time) (bool, time.Duration) {
	st := e.beginStep(now)
	if st == nil {
		return false, 0
	}
	e.writeStep(st)
	e.writesLanded = true
	e.sampleStep(st)
	return true, e.endStep(st, now)
}

// runStep computes a step put in flight by beginStep with mu released
// (see Engine) and commits it.
func (e *Engine) runStep(st *stepWork, now time.Time) time.Duration {
	e.writeStep(st)
	e.mu.Lock()
	e.writesLanded = true
	e.mu.Unlock()
	e.boundary.Broadcast()
	e.sampleStep(st)
	e.mu.Lock()
	model := e.endStep(st, now)
	e.mu.Unlock()
	e.boundary.Broadcast()
	return model
}

// stepWork is one step in flight: its batch, the generation its writes
// are stamped with, and what its compute produced.
type stepWork struct {
	batch   []work
	gen     uint64
	start   time.Time
	sampled []int    // indexes into batch of the requests that draw a token
	sums    []uint64 // their KV hashes, nil if the read failed
}

// beginStep schedules a step and puts it in flight (under mu); nil when
// nothing is runnable.
func (e *Engine) beginStep(now time.Time) *stepWork {
	batch := e.schedule(now)
	if len(batch) == 0 {
		return nil
	}
	e.steps++
	st := &stepWork{batch: batch, gen: e.cursor + 1, start: time.Now()}
	for i, w := range batch {
		w.r.inFlight = true
		if w.r.numComputed+w.tokens == w.r.numTokens() {
			st.sampled = append(st.sampled, i)
		}
	}
	e.inFlight, e.writesLanded = true, false
	return st
}

// writeStep writes the batch's KV. It runs without mu: nothing it reads
// (the batch's block tables and positions) changes while the step is in
// flight, and nothing frees its blocks before it commits.
func (e *Engine) writeStep(st *stepWork) {
	for _, w := range st.batch {
		r := w.r
		for i := 0; i < w.tokens; i++ {
			pos := r.numComputed + i
			b, slot := r.blocks[pos/e.geo.BlockSize], pos%e.geo.BlockSize
			e.kv.writeToken(b, slot, r.kvSeed(pos, e.geo.BlockSize), r.token(pos), pos)
		}
	}
	// Writes land before any read of this step; requests never write a
	// block they share (a shared block is a full one, computed before), so
	// writing all then sampling all reads what sampling each right after
	// its own writes would.
	if err := e.kv.flushWrites(); err != nil {
		e.log.Error("KV write failed", zap.Error(err))
	}
}

// sampleStep hashes the KV each sampling request's next token comes from
// (without mu, as writeStep).
func (e *Engine) sampleStep(st *stepWork) {
	rs := make([]*request, len(st.sampled))
	for i, j := range st.sampled {
		rs[i] = st.batch[j].r
	}
	sums, err := e.kv.sampleSums(rs, e.sampleHash)
	if err != nil {
		e.log.Error("KV read failed", zap.Error(err))
	}
	st.sums = sums
}

// endStep commits a step (under mu): each request's computed positions,
// the write log, its token; a request whose pause dropped the step keeps
// none of it (inflight.go). It returns the modelled step duration.
func (e *Engine) endStep(st *stepWork, now time.Time) time.Duration {
	ctxTokens, prefill := 0, 0
	dropped := make([]bool, len(st.batch))
	for i, w := range st.batch {
		r := w.r
		r.inFlight = false
		if w.tokens > 1 || r.numComputed < len(r.prompt) {
			prefill += w.tokens
		}
		if r.dropStep {
			r.dropStep, dropped[i] = false, true
			ctxTokens += r.numComputed + w.tokens
			continue
		}
		for k := 0; k < w.tokens; k++ {
			pos := r.numComputed + k
			e.pool.markWritten(r.blocks[pos/e.geo.BlockSize], pos%e.geo.BlockSize, st.gen)
		}
		r.numComputed += w.tokens
		e.cacheComputed(r, r.numComputed-w.tokens)
		ctxTokens += r.numComputed
	}
	if st.sums != nil {
		for i, j := range st.sampled {
			if !dropped[j] {
				e.sampleEmit(st.batch[j].r, st.sums[i], now)
			}
		}
	}
	e.cursor = st.gen
	e.inFlight, e.writesLanded = false, false
	e.lastCompute = time.Since(st.start)
	// Data-parallel ranks step together (DP attention with EP MoE
	// synchronizes them), each over its share of the batch.
	dp := e.dpSize
	e.lastStep = e.cfg.Step.Duration((len(st.batch)+dp-1)/dp, ctxTokens/dp, prefill/dp)
	e.met.stepDone(e.lastStep, e.lastCompute)
	return e.lastStep
}

// schedule picks this step's batch: running requests first (decode or the
// next prefill chunk), then waiting ones while seats, token budget and blocks
// last. When blocks run out it preempts the latest-arrived running request
// by recompute, as vLLM does.
func (e *Engine) schedule(now time.Time) []work {
	if e.pausedAll || e.elasticPaused {
		return nil
	}
	// Every data-parallel rank brings its own seats and token budget.
	budget := e.cfg.MaxNumBatchedTokens * e.dpSize
	var batch []work
	for i := 0; i < len(e.running) && budget > 0; i++ {
		r := e.running[i]
		if r.paused || e.heldAtTail(r) {
			continue
		}
		n := min(r.numTokens()-r.numComputed, budget)
		if n <= 0 {
			continue
		}
		for !e.ensureBlocks(r, r.numComputed+n) {
			victim := e.preemptionVictim(i)
			e.preempt(victim)
			if victim == r {
				break
			}
		}
		if r.state != stateRunning {
			i-- // r itself was preempted and removed from running
			continue
		}
		batch = append(batch, work{r, n})
		budget -= n
	}
	for len(e.waiting) > 0 && len(e.running) < e.cfg.MaxNumSeqs*e.dpSize && budget > 0 && !e.pausedNew {
		idx := -1
		for i, r := range e.waiting {
			if !r.paused {
				idx = i
				break
			}
		}
		if idx < 0 {
			break
		}
		r := e.waiting[idx]
		reused := e.reuseCached(r)
		n := min(r.numTokens()-r.numComputed, budget)
		if !e.ensureBlocks(r, r.numComputed+n) {
			e.unreuse(r, reused)
			break
		}
		e.waiting = append(e.waiting[:idx], e.waiting[idx+1:]...)
		r.state = stateRunning
		if r.scheduledAt.IsZero() {
			r.scheduledAt = now
			e.met.queueTime.Observe(now.Sub(r.arrival).Seconds())
		}
		e.running = append(e.running, r)
		batch = append(batch, work{r, n})
		budget -= n
	}
	return batch
}

// ensureBlocks grows r's block table to hold n tokens.
func (e *Engine) ensureBlocks(r *request, n int) bool {
	need := (n+e.geo.BlockSize-1)/e.geo.BlockSize - len(r.blocks)
	if need <= 0 {
		return true
	}
	got, ok := e.pool.allocate(need, r.id)
	if !ok {
		return false
	}
	r.blocks = append(r.blocks, got...)
	return true
}

// preemptionVictim is the latest-arrived unpaused running request not yet
// scheduled this step (those after index i), or running[i] itself.
func (e *Engine) preemptionVictim(i int) *request {
	for j := len(e.running) - 1; j > i; j-- {
		if c := e.running[j]; !c.paused {
			return c
		}
	}
	return e.running[i]
}

// preempt frees r's blocks and puts it at the front of the waiting queue to
// recompute its prompt and output later.
func (e *Engine) preempt(r *request) {
	e.pool.release(r.blocks, e.cursor+1)
	r.blocks = nil
	r.numComputed = 0
	r.state = stateWaiting
	r.preempted = true
	r.numPreemptions++
	e.removeRunning(r)
	e.waiting = append([]*request{r}, e.waiting...)
	e.met.preemptions.Inc()
}

func (e *Engine) removeRunning(r *request) {
	for i, c := range e.running {
		if c == r {
			e.running = append(e.running[:i], e.running[i+1:]...)
			return
		}
	}
}

func (e *Engine) removeWaiting(r *request) {
	for i, c := range e.waiting {
		if c == r {
			e.waiting = append(e.waiting[:i], e.waiting[i+1:]...)
			return
		}
	}
}

// sampleGroups splits each earlier block into this many layer groups; a
// step reads one (block, group) unit. Reading a whole earlier block per
// sequence per step costs ~50 µs of TLB and cache misses on this machine
// (72 separate 1 KiB runs): at 256 sequences that alone would exceed the
// modelled step. A quarter keeps the sim under a core (docs/benchmarks.md)
// while every byte is still read many times over a sequence.
const sampleGroups = 4

// sampleHash hashes the KV bytes r's next token is computed from: all
// written slots of the tail block and a quarter of one earlier block
// (sampledBlock over (block, layer group) units), so every byte of every
// block is read again and again over the sequence. Same bytes ⇒ same token; any altered byte ⇒ (almost surely) a
// different one.
func (e *Engine) sampleHash(d *xxhash.Digest, rd kvReader, r *request) {
	pos := r.numTokens() // position of the token being produced
	bs := e.geo.BlockSize
	tail := (pos - 1) / bs
	e.kv.hashSlots(d, rd, r.blocks[tail], (pos-1)%bs+1, 0, 1)
	if tail > 0 {
		u := sampledBlock(pos, tail*sampleGroups)
		e.kv.hashSlots(d, rd, r.blocks[u/sampleGroups], bs, u%sampleGroups, sampleGroups)
	}
}

// sampleEmit turns the hash of r's KV (sampleHash) into its next token.
func (e *Engine) sampleEmit(r *request, sum uint64, now time.Time) {
	pos := r.numTokens()
	state := mix64(sum ^ uint64(r.params.Seed)*0xD6E8FEB86659FD93 ^ uint64(pos))
	if e.weightsStale {
		state = mix64(state ^ 0x9E3779B97F4A7C15) // what garbage weights compute
	}

	var tok int
	if !r.params.IgnoreEOS && e.cfg.EOSOneIn > 0 && state%uint64(e.cfg.EOSOneIn) == 0 {
		tok = tokenizer.EOS
	} else {
		tok = e.pick(state, r.params.Temperature, r.params.Seed, len(r.output))
	}
	e.emit(r, tok, now)
}

// pick chooses among eight candidate words whose logits fall by one per
// rank: greedy takes the first; with temperature the request's own RNG
// stream (seed, draw index) samples the softmax. The draw index is the RNG
// position a migration carries over.
func (e *Engine) pick(state uint64, temperature float64, seed int64, draw int) int {
	const k = 8
	if temperature <= 0 {
		return e.tok.WordID(mix64(state))
	}
	u := float64(mix64(uint64(seed)^0xA0761D6478BD642F*uint64(draw+1))>>11) / (1 << 53)
	var w [k]float64
	sum := 0.0
	for i := range w {
		w[i] = math.Exp(-float64(i) / temperature)
		sum += w[i]
	}
	acc := 0.0
	for i := range w {
		acc += w[i] / sum
		if u < acc {
			return e.tok.WordID(mix64(state + uint64(i)))
		}
	}
	return e.tok.WordID(mix64(state + k - 1))
}

// emit appends a sampled token, applies the stop conditions and publishes.
func (e *Engine) emit(r *request, tok int, now time.Time) {
	r.output = append(r.output, tok)
	e.met.generationTokens.Inc()
	if r.firstTokenAt.IsZero() {
		r.firstTokenAt = now
		e.met.ttft.Observe(now.Sub(r.arrival).Seconds())
	} else {
		e.met.itl.Observe(now.Sub(r.lastTokenAt).Seconds())
	}
	r.lastTokenAt = now
	hit, stopped := r.appendText(e.tok.Piece(tok))
	switch {
	case stopped:
		e.finish(r, "stop", hit, now)
	case tok == tokenizer.EOS && !r.params.IgnoreEOS:
		e.finish(r, "stop", nil, now)
	case containsInt(r.params.StopTokenIDs, tok):
		e.finish(r, "stop", tok, now)
	case len(r.output) >= r.params.MaxTokens || r.numTokens() >= e.cfg.MaxModelLen:
		e.finish(r, "length", nil, now)
	default:
		r.publish()
	}
}

// finish ends r, frees its blocks and publishes the end to its streams.
func (e *Engine) finish(r *request, reason string, stopReason any, now time.Time) {
	if r.finished() {
		return
	}
	if len(r.blocks) > 0 {
		e.pool.release(r.blocks, e.cursor+1)
		r.blocks = nil
	}
	switch r.state {
	case stateRunning:
		e.removeRunning(r)
	case stateWaiting:
		e.removeWaiting(r)
	}
	r.state = stateFinished
	r.finishReason, r.stopReason = reason, stopReason
	r.finishedAt = now
	r.releaseText()
	delete(e.requests, r.id)
	e.done[r.id] = r
	if !r.silent {
		e.met.finished(r, now)
	}
	r.publish()
}

// expireLeases resumes hook-paused requests and releases reservations whose
// lease ran out (the Host may have died mid-migration), and forgets finished
// requests past retention.
func (e *Engine) expireLeases(now time.Time) {
	var resumed, dropped []string
	released := false
	for _, r := range e.requests {
		switch {
		case r.uncommitted && now.After(r.pauseDeadline):
			r.silent = true
			e.finish(r, "abort", nil, now)
			dropped = append(dropped, r.id)
			released = true
		case r.paused && !r.pauseDeadline.IsZero() && now.After(r.pauseDeadline):
			r.paused = false
			r.pauseDeadline = time.Time{}
			resumed = append(resumed, r.id)
		case r.state == stateReserved && now.After(r.reserveUntil):
			e.log.Warn("block reservation lease expired; releasing", zap.String("request_id", r.id), zap.Int("blocks", len(r.blocks)))
			e.pool.release(r.blocks, e.cursor+1)
			r.blocks = nil
			delete(e.requests, r.id)
			released = true
		}
	}
	if released {
		e.cursor++
	}
	if len(resumed) > 0 {
		sort.Strings(resumed)
		e.log.Warn("pause lease expired with no confirmation; resuming", zap.Strings("request_ids", resumed))
	}
	if len(dropped) > 0 {
		sort.Strings(dropped)
		e.log.Warn("installed requests were never committed (the migration did not finish); dropping them", zap.Strings("request_ids", dropped))
	}
	for id, r := range e.done {
		if now.Sub(r.finishedAt) > e.cfg.FinishedRetention {
			delete(e.done, id)
			e.watchable.CompareAndDelete(id, r)
		}
	}
}

// sampledBlock picks which of the first n (full) blocks to read at position
// pos: the golden-ratio sequence frac(pos·φ) scaled to n. It is
// equidistributed with the lowest discrepancy there is (three-gap theorem),
// so every block is hit within a few n steps even though n grows as the
// sequence does; and it depends on the position alone, so every instance
// reads the same block at the same position.
func sampledBlock(pos, n int) int {
	hi, _ := bits.Mul64(uint64(pos)*0x9E3779B97F4A7C15, uint64(n))
	return int(hi)
}

func containsInt(xs []int, x int) bool {
	for _, v := range xs {
		if v == x {
			return true
		}
	}
	return false
}

// Preemptions is how many times a request was preempted by recompute.
func (e *Engine) Preemptions() int {
	e.lock()
	defer e.mu.Unlock()
	n := 0
	for _, r := range e.requests {
		n += r.numPreemptions
	}
	for _, r := range e.done {
		n += r.numPreemptions
	}
	return n
}

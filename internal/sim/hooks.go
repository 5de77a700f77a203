package sim

import (
	"context"
	"encoding/base64"
	"fmt"
	"math"
	"os"
	"sort"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/version"
)

var _ hooks.Engine = (*Engine)(nil)

// Layout implements hooks.Engine.
func (e *Engine) Layout(context.Context) (hooks.Layout, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	l := hooks.Layout{
		Engine: "vhi-sim", EngineVersion: version.Version(), HooksVersion: hooks.Version,
		Model: e.cfg.Model, ServedModels: e.cfg.ServedModelNames,
		Geometry: e.geo, Parallel: e.par, KVLayout: e.cfg.KVLayout, KVGeneration: e.kvGen, Regions: []hooks.Region{},
	}
	if e.kv == nil {
		// Sleeping: the geometry stands, the memory is gone.
		return l, nil
	}
	for _, r := range e.kv.regions {
		rl := r.layout
		mem := hooks.Memory{Kind: hooks.MemoryShm, Path: r.path}
		if e.kv.gpu != nil {
			dev := e.kv.gpu.devs[r.gpuAt].dev
			h, err := e.cuda.IPCGet(dev, r.dptr)
			if err != nil {
				return hooks.Layout{}, fmt.Errorf("export the KV of GPU %d: %w", dev, err)
			}
			uuid, err := e.cuda.DeviceUUID(dev)
			if err != nil {
				return hooks.Layout{}, fmt.Errorf("name GPU %d: %w", dev, err)
			}
			mem = hooks.Memory{Kind: hooks.MemoryCUDAIPC, Device: dev, DeviceUUID: uuid, IPCHandle: base64.StdEncoding.EncodeToString(h[:]),
				PID: os.Getpid(), DevicePointer: uint64(r.dptr), Node: hostname()}
		}
		l.Regions = append(l.Regions, hooks.Region{
			TPRank: rl.Shard.TPRank, PPStage: rl.Shard.PPStage,
			FirstLayer: rl.FirstLayer, NumLayers: rl.NumLayers, FirstHead: rl.FirstHead, NumHeads: rl.NumHeads,
			Size: rl.Size(), LayerStride: rl.LayerStride(), KVStride: rl.KVStride(),
			BlockStride: rl.BlockStride(), HeadStride: rl.HeadStride(), SlotStride: rl.SlotStride(),
			Memory: mem,
		})
	}
	return l, nil
}

// Requests implements hooks.Engine.
func (e *Engine) Requests(context.Context) (hooks.RequestList, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := hooks.RequestList{Cursor: e.cursor, FreeBlocks: e.pool.numFree(), TotalBlocks: e.pool.total(), Requests: []hooks.RequestInfo{}}
	for _, r := range e.running {
		out.Requests = append(out.Requests, r.info())
	}
	for _, r := range e.waiting {
		out.Requests = append(out.Requests, r.info())
	}
	return out, nil
}

// Changes implements hooks.Engine: blocks (with their slot ranges) written
// after since, and blocks freed after since and still free.
func (e *Engine) Changes(_ context.Context, since uint64) (hooks.Changes, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if since > e.cursor {
		return hooks.Changes{}, badRequest("since", "Cursor %d is ahead of the engine's cursor %d.", since, e.cursor)
	}
	c := hooks.Changes{Since: since, Cursor: e.cursor, Written: []hooks.BlockWrite{}, Freed: []int{}}
	p := e.pool
	for b := 1; b < len(p.allocated); b++ {
		switch {
		case p.allocated[b] && p.writeGen[b] > since:
			first, n := p.changedSlots(b, since)
			c.Written = append(c.Written, hooks.BlockWrite{Block: b, FirstSlot: first, NumSlots: n, RequestID: p.owner[b]})
		case !p.allocated[b] && p.freeGen[b] > since:
			c.Freed = append(c.Freed, b)
		}
	}
	return c, nil
}

// lookup resolves ids (all live requests when ids is empty) or fails with
// 404 naming the first unknown one. Nothing is changed on failure.
func (e *Engine) lookup(ids []string, allowReserved bool) ([]*request, error) {
	if len(ids) == 0 {
		out := make([]*request, 0, len(e.requests))
		for _, r := range e.requests {
			if r.state != stateReserved {
				out = append(out, r)
			}
		}
		sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
		return out, nil
	}
	out := make([]*request, 0, len(ids))
	for _, id := range ids {
		r := e.requests[id]
		if r == nil || (r.state == stateReserved && !allowReserved) {
			return nil, notFound("request_ids", "Request %s is not running on this engine.", id)
		}
		out = append(out, r)
	}
	return out, nil
}

// present splits ids into the requests the engine runs (or holds paused)
// and those it no longer has.
func (e *Engine) present(ids []string) (have, missing []string) {
	for _, id := range ids {
		if r := e.requests[id]; r != nil && r.state != stateReserved {
			have = append(have, id)
		} else {
			missing = append(missing, id)
		}
	}
	return have, missing
}

func (e *Engine) lease(ms int) time.Duration {
	if ms <= 0 {
		return e.cfg.DefaultPauseLease
	}
	return time.Duration(ms) * time.Millisecond
}

// Pause implements hooks.Engine. It lands at a step boundary, or with
// DropInFlight as soon as the step in flight has written its KV, that
// step's work for the paused requests dropped (inflight.go).
func (e *Engine) Pause(_ context.Context, req hooks.PauseRequest) (hooks.PauseResponse, error) {
	called := time.Now()
	e.lockForPause(req.DropInFlight)
	defer e.mu.Unlock()
	wait := time.Since(called)
	ids, missing := req.RequestIDs, []string(nil)
	if req.IgnoreMissing {
		ids, missing = e.present(ids)
	}
	var rs []*request
	if len(ids) > 0 || len(missing) == 0 { // every named request gone: pause none, not all
		var err error
		if rs, err = e.lookup(ids, false); err != nil {
			return hooks.PauseResponse{}, err
		}
	}
	deadline := time.Now().Add(e.lease(req.LeaseMS))
	out := hooks.PauseResponse{Paused: []string{}, Missing: missing, Cursor: e.cursor, LeaseExpiresAt: unixSeconds(deadline), StepWaitS: wait.Seconds()}
	for _, r := range rs {
		r.paused = true
		r.pauseDeadline = deadline
		out.Paused = append(out.Paused, r.id)
		if r.inFlight && !r.dropStep {
			r.dropStep = true
			out.DroppedInFlight++
		}
	}
	return out, nil
}

// Resume implements hooks.Engine.
func (e *Engine) Resume(_ context.Context, req hooks.ResumeRequest) (hooks.ResumeResponse, error) {
	e.lock()
	rs, err := e.lookup(req.RequestIDs, false)
	if err != nil {
		e.mu.Unlock()
		return hooks.ResumeResponse{}, err
	}
	out := hooks.ResumeResponse{Resumed: []string{}}
	for _, r := range rs {
		if r.paused {
			r.paused, r.uncommitted = false, false
			r.pauseDeadline = time.Time{}
			out.Resumed = append(out.Resumed, r.id)
		}
	}
	e.mu.Unlock()
	e.signal()
	return out, nil
}

// Export implements hooks.Engine. Only paused requests can be exported: a
// running one would change under the caller.
func (e *Engine) Export(_ context.Context, req hooks.ExportRequest) (hooks.ExportResponse, error) {
	if req.Snapshot {
		e.lock() // running requests: as they are between steps
	} else {
		e.mu.Lock() // paused ones do not move (inflight.go)
	}
	defer e.mu.Unlock()
	if len(req.RequestIDs) == 0 {
		return hooks.ExportResponse{}, badRequest("request_ids", "request_ids must name at least one request.")
	}
	out := hooks.ExportResponse{Cursor: e.cursor}
	if req.Snapshot {
		// Running requests as they are now; those that ended are left out.
		for _, id := range req.RequestIDs {
			if r := e.requests[id]; r != nil && r.state != stateReserved {
				out.Requests = append(out.Requests, r.exportState())
			}
		}
		return out, nil
	}
	rs, err := e.lookup(req.RequestIDs, false)
	if err != nil {
		return hooks.ExportResponse{}, err
	}
	for _, r := range rs {
		if !r.paused {
			return hooks.ExportResponse{}, conflict("Request %s is not paused; pause it before exporting.", r.id)
		}
		out.Requests = append(out.Requests, r.exportState())
	}
	return out, nil
}

// Allocate implements hooks.Engine: all or nothing.
func (e *Engine) Allocate(_ context.Context, req hooks.AllocateRequest) (hooks.AllocateResponse, error) {
	e.lock()
	defer e.mu.Unlock()
	if e.kv == nil {
		return hooks.AllocateResponse{}, conflict("The engine is sleeping: its KV cache is released.")
	}
	if req.Extend {
		return e.extendLocked(req), nil
	}
	need := 0
	// The items earlier in the call that hold blocks, and how many: what a
	// shared prefix may name.
	blocksOf := map[string]int{}
	seen := map[string]bool{}
	for _, it := range req.Requests {
		switch {
		case it.RequestID == "":
			return hooks.AllocateResponse{}, badRequest("request_id", "Every item needs a request_id.")
		case it.NumTokens < 1 || it.NumTokens > e.cfg.MaxModelLen:
			return hooks.AllocateResponse{}, badRequest("num_tokens", "num_tokens %d of %s is outside 1..%d.", it.NumTokens, it.RequestID, e.cfg.MaxModelLen)
		case e.requests[it.RequestID] != nil || seen[it.RequestID]:
			return hooks.AllocateResponse{}, conflict("Request %s already exists on this engine.", it.RequestID)
		}
		seen[it.RequestID] = true
		if it.Recompute {
			continue
		}
		k := (it.NumTokens + e.geo.BlockSize - 1) / e.geo.BlockSize
		blocksOf[it.RequestID] = k
		if sp := it.SharedPrefix; sp != nil {
			// A request writes its next tokens past what it shares: at
			// least its last block is its own.
			if held, ok := blocksOf[sp.RequestID]; !ok || sp.Blocks < 1 || sp.Blocks > min(held, k-1) {
				return hooks.AllocateResponse{}, badRequest("shared_prefix",
					"Request %s shares %d blocks with %s, which is not an earlier item of this call holding that many, or leaves it none of its own %d.",
					it.RequestID, sp.Blocks, sp.RequestID, k)
			}
			k -= sp.Blocks
		}
		need += k
	}
	if need > e.pool.numFree() {
		return hooks.AllocateResponse{}, insufficient("Need %d KV blocks, %d free.", need, e.pool.numFree())
	}
	until := time.Now().Add(e.lease(req.LeaseMS))
	out := hooks.AllocateResponse{}
	for _, it := range req.Requests {
		if it.Recompute {
			e.requests[it.RequestID] = &request{id: it.RequestID, state: stateReserved, reserveUntil: until, recompute: true}
			out.Requests = append(out.Requests, hooks.AllocatedItem{RequestID: it.RequestID, BlockIDs: []int{}, Recompute: true})
			continue
		}
		k := (it.NumTokens + e.geo.BlockSize - 1) / e.geo.BlockSize
		var blocks []int
		if sp := it.SharedPrefix; sp != nil {
			// The same KV as the earlier item's first blocks: one set of
			// blocks, held by both (validated above).
			blocks = append(blocks, e.requests[sp.RequestID].blocks[:sp.Blocks]...)
			e.pool.share(blocks)
		}
		rest, _ := e.pool.allocate(k-len(blocks), it.RequestID)
		blocks = append(blocks, rest...)
		e.requests[it.RequestID] = &request{id: it.RequestID, blocks: blocks, state: stateReserved, reserveUntil: until}
		out.Requests = append(out.Requests, hooks.AllocatedItem{RequestID: it.RequestID, BlockIDs: append([]int(nil), blocks...)})
	}
	out.FreeBlocks = e.pool.numFree()
	return out, nil
}

// extendLocked renews the leases of the reservations req names that are
// still reservations (hooks.AllocateRequest.Extend).
func (e *Engine) extendLocked(req hooks.AllocateRequest) hooks.AllocateResponse {
	until := time.Now().Add(e.lease(req.LeaseMS))
	out := hooks.AllocateResponse{Requests: []hooks.AllocatedItem{}}
	for _, it := range req.Requests {
		r := e.requests[it.RequestID]
		if r == nil || r.state != stateReserved {
			continue
		}
		r.reserveUntil = until
		out.Requests = append(out.Requests, hooks.AllocatedItem{RequestID: r.id, BlockIDs: append([]int{}, r.blocks...), Recompute: r.recompute})
	}
	out.FreeBlocks = e.pool.numFree()
	return out
}

// Install implements hooks.Engine: the KV is already in the reserved
// blocks (the agent wrote it); this adds the scheduler state and joins the
// running batch, paused unless Resume.
func (e *Engine) Install(_ context.Context, req hooks.InstallRequest) (hooks.InstallResponse, error) {
	e.failAt(FailpointStopOnInstall)
	e.lock()
	defer e.mu.Unlock()
	// Everything is checked before anything changes: a refused install
	// leaves the engine as it was.
	seen := map[string]bool{}
	for _, st := range req.Requests {
		r := e.requests[st.RequestID]
		if r == nil || r.state != stateReserved {
			return hooks.InstallResponse{}, notFound("request_id", "Request %s has no reservation on this engine; allocate first.", st.RequestID)
		}
		if seen[st.RequestID] {
			return hooks.InstallResponse{}, badRequest("request_id", "Request %s is named twice.", st.RequestID)
		}
		seen[st.RequestID] = true
		if r.recompute {
			// No KV came: the engine computes it again, so nothing of the
			// source's counts as computed, and blocks are found later.
			st.NumComputedTokens = 0
		}
		if err := e.checkState(st, len(r.blocks), r.recompute); err != nil {
			return hooks.InstallResponse{}, err
		}
	}
	gen := e.cursor + 1
	out := hooks.InstallResponse{Installed: []string{}}
	for _, st := range req.Requests {
		r := e.requests[st.RequestID]
		r.prompt = append([]int(nil), st.PromptTokenIDs...)
		r.blockHashes = e.promptBlockHashes(r.prompt)
		r.output = append([]int(nil), st.OutputTokenIDs...)
		r.text = st.OutputText
		r.textOffsets = append([]int(nil), st.TextOffsets...)
		r.numComputed = st.NumComputedTokens
		if r.recompute {
			r.numComputed = 0
		}
		r.params = st.Sampling
		if textToDerive(st) {
			// Token ids alone (a failover from the tokens the Host's relay
			// saw): the text is what this engine's tokenizer makes of them,
			// stop strings held back as when it generated them.
			r.text, r.textOffsets = "", nil
			for _, t := range r.output {
				r.appendText(e.tok.Piece(t))
			}
		}
		r.meta = st.Response
		r.arrival = fromUnixSeconds(st.ArrivalTime)
		r.priority = st.Priority
		r.state = stateRunning
		r.scheduledAt = time.Now()
		r.firstTokenAt = r.scheduledAt
		r.lastTokenAt = r.scheduledAt
		r.paused, r.uncommitted = !req.Resume, !req.Resume
		r.pauseDeadline = time.Time{}
		if r.paused {
			r.pauseDeadline = time.Now().Add(e.lease(req.LeaseMS))
		}
		// Blocks past the computed tokens may be spare; the KV the agent
		// wrote counts as written now, so a later migration off this engine
		// sees it.
		used := (r.numComputed + e.geo.BlockSize - 1) / e.geo.BlockSize
		for pos := 0; pos < r.numComputed && pos/e.geo.BlockSize < used; pos++ {
			e.pool.markWritten(r.blocks[pos/e.geo.BlockSize], pos%e.geo.BlockSize, gen)
		}
		if r.recompute {
			// Queued behind what waits already, as a preempted request:
			// scheduled (and its KV recomputed) once seats and blocks allow.
			r.state, r.preempted = stateWaiting, true
			e.waiting = append(e.waiting, r)
		} else {
			e.running = append(e.running, r)
		}
		r.installed, r.installedFrom = true, len(r.output)
		r.publish()
		e.watchable.Store(r.id, r)
		out.Installed = append(out.Installed, r.id)
	}
	close(e.installs)
	e.installs = make(chan struct{})
	e.cursor = gen
	e.signal()
	return out, nil
}

// checkState refuses a request state the engine could not run: every
// field an install reads is bounded here, so a malformed body is a 400,
// never a panic later in a step or a stream.
func (e *Engine) checkState(st hooks.RequestState, reservedBlocks int, recompute bool) error {
	bs := e.geo.BlockSize
	total := len(st.PromptTokenIDs) + len(st.OutputTokenIDs)
	vocab := e.tok.VocabSize()
	switch {
	case len(st.PromptTokenIDs) == 0:
		return badRequest("prompt_token_ids", "Request %s has no prompt tokens.", st.RequestID)
	case total > e.cfg.MaxModelLen:
		return badRequest("output_token_ids", "Request %s: %d tokens exceed max_model_len %d.", st.RequestID, total, e.cfg.MaxModelLen)
	case st.NumComputedTokens < 0 || st.NumComputedTokens > total:
		return badRequest("num_computed_tokens", "Request %s: num_computed_tokens %d outside 0..%d.", st.RequestID, st.NumComputedTokens, total)
	case st.NumComputedTokens > reservedBlocks*bs:
		return badRequest("num_computed_tokens", "Request %s: %d computed tokens do not fit its %d reserved blocks.", st.RequestID, st.NumComputedTokens, reservedBlocks)
	case !recompute && (total+bs-1)/bs > reservedBlocks+e.pool.numFree():
		return insufficient("Request %s needs more blocks than are reserved and free.", st.RequestID)
	case len(st.TextOffsets) != len(st.OutputTokenIDs) && !textToDerive(st):
		return badRequest("text_offsets", "Request %s: %d text offsets for %d output tokens.", st.RequestID, len(st.TextOffsets), len(st.OutputTokenIDs))
	case st.Sampling.MaxTokens < 1 || st.Sampling.MaxTokens > e.cfg.MaxModelLen:
		return badRequest("sampling_params", "Request %s: max_tokens must be in 1..%d.", st.RequestID, e.cfg.MaxModelLen)
	case !(st.Sampling.Temperature >= 0) || math.IsInf(st.Sampling.Temperature, 0):
		return badRequest("sampling_params", "Request %s: temperature must be a non-negative number.", st.RequestID)
	case !(st.Sampling.TopP >= 0 && st.Sampling.TopP <= 1): // 0: not set
		return badRequest("sampling_params", "Request %s: top_p must be in [0, 1].", st.RequestID)
	case st.RNGPosition < 0:
		return badRequest("rng_position", "Request %s: rng_position must not be negative.", st.RequestID)
	}
	for _, ids := range [][]int{st.PromptTokenIDs, st.OutputTokenIDs, st.Sampling.StopTokenIDs} {
		for _, t := range ids {
			if t < 0 || t >= vocab {
				return badRequest("output_token_ids", "Request %s: token id %d is out of vocabulary (size %d).", st.RequestID, t, vocab)
			}
		}
	}
	prev := 0
	for i, off := range st.TextOffsets {
		if off < prev || off > len(st.OutputText) {
			return badRequest("text_offsets", "Request %s: text offset %d (%d) is not in order within the %d bytes of output text.", st.RequestID, i, off, len(st.OutputText))
		}
		prev = off
	}
	return nil
}

// Abort implements hooks.Engine.
func (e *Engine) Abort(_ context.Context, req hooks.AbortRequest) (hooks.AbortResponse, error) {
	e.lock()
	defer e.mu.Unlock()
	if len(req.RequestIDs) == 0 {
		return hooks.AbortResponse{}, badRequest("request_ids", "request_ids must name at least one request.")
	}
	ids := req.RequestIDs
	if req.IgnoreMissing || req.ReservedOnly {
		ids = ids[:0:0]
		for _, id := range req.RequestIDs {
			r := e.requests[id]
			if r != nil && (!req.ReservedOnly || r.state == stateReserved || r.uncommitted) {
				ids = append(ids, id)
			}
		}
		if len(ids) == 0 {
			return hooks.AbortResponse{Aborted: []string{}}, nil
		}
	}
	rs, err := e.lookup(ids, true)
	if err != nil {
		return hooks.AbortResponse{}, err
	}
	out := hooks.AbortResponse{Aborted: []string{}}
	now := time.Now()
	for _, r := range rs {
		if r.state == stateReserved {
			e.pool.release(r.blocks, e.cursor+1)
			r.blocks = nil
			delete(e.requests, r.id)
		} else {
			r.silent = req.Silent
			e.finish(r, "abort", nil, now)
		}
		out.Aborted = append(out.Aborted, r.id)
	}
	e.cursor++
	return out, nil
}

// Stats implements hooks.Engine.
func (e *Engine) Stats(context.Context) (hooks.Stats, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := hooks.Stats{
		Cursor: e.cursor, TotalBlocks: e.pool.total(), FreeBlocks: e.pool.numFree(),
		NumRunning: len(e.running), NumWaiting: len(e.waiting),
		PausedAll: e.pausedAll, Sleeping: e.sleeping, Steps: e.steps,
	}
	s.UsedBlocks = s.TotalBlocks - s.FreeBlocks
	for _, r := range e.requests {
		if r.state == stateReserved {
			s.ReservedBlocks += len(r.blocks)
		}
		if r.paused {
			s.NumPaused++
		}
	}
	return s, nil
}

// hostname names this node in cuda_ipc memory descriptions ("" if unknown).
func hostname() string {
	h, _ := os.Hostname()
	return h
}

// textToDerive reports whether an installed state brings output token ids
// without their text, for the engine to derive.
func textToDerive(st hooks.RequestState) bool {
	return len(st.TextOffsets) == 0 && st.OutputText == "" && len(st.OutputTokenIDs) > 0
}

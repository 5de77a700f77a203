package failover

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"sort"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// A warm standby keeps a copy of a long stream's KV on another instance
// of its model, so that when the stream's engine dies the survivor
// installs what was copied and computes only the tokens since, instead of
// prefilling the whole context again. It is a migration's copy rounds
// without the pause and the switch: each Config.WarmInterval a stream
// whose context reached Config.WarmTokens (as of its last snapshot) gets blocks
// reserved on the survivor with the most free KV and a full round; the
// streams copied already get an incremental round of what their engine
// wrote since. The reservations are held by lease (renewed each cycle:
// hooks.AllocateRequest.Extend), so a Host that stops leaves nothing
// behind for long.
//
// What the standby holds is known from the snapshot taken before the
// round: every output token in it was sampled by a step that had written
// the KV of the positions before it, so the round, which reads after the
// snapshot, copied at least the snapshot's tokens less the last one —
// with vLLM's asynchronous scheduling too (a token is in the snapshot
// only once its step's output came back).

// copyOf is one stream's warm copy.
type copyOf struct {
	id       string
	src, dst string            // instance ids: the stream's engine, the standby
	blocks   *v1.RequestBlocks // source and standby block ids, as the last round left them
	prompt   int               // prompt tokens (the copy is of a request in decode)
	covered  int               // positions [0, covered) of the KV are on the standby (0: no round finished yet)
	checked  int               // positions [0, checked) were found equal on both sides (warmcheck.go)
	needs    int               // tokens reserved on the standby
}

// pairing is one source's copies on one standby: their rounds are serial.
type pairing struct {
	mu     sync.Mutex // held by a round, and by a recovery installing from the pair
	cursor uint64     // the source's write-log cursor the last round copied up to
	fresh  bool       // no round yet (the next one is full for everyone)
	cancel context.CancelFunc
}

// standbys holds the warm copies.
type standbys struct {
	mu     sync.Mutex
	copies map[string]*copyOf     // by request id
	pairs  map[[2]string]*pairing // by source and standby instance
	bytes  int64                  // copied since start
	used   int                    // recoveries that installed a copy
	// differed counts copies dropped by the check after a round.
	differed int
	// batches gather a dead engine's recoveries by pair (installWarm).
	batches map[[2]string]*warmBatch
}

func newStandbys() *standbys {
	return &standbys{copies: map[string]*copyOf{}, pairs: map[[2]string]*pairing{}, batches: map[[2]string]*warmBatch{}}
}

// warmLease is how long a standby holds a copy's reservation (and takes
// its rounds' data) without hearing from this Host: a few cycles, and at
// least one cycle held up for its whole deadline by a source that stopped
// answering (a pair's next renewal waits for its last cycle to end), so
// that the copies outlast the time it takes to decide that source failed.
func (m *Manager) warmLease() time.Duration {
	cycle := max(m.cfg.SnapshotInterval, m.cfg.WarmInterval)
	return max(3*cycle+2*time.Second, m.cfg.Timeout+2*cycle)
}

// WarmCopies is how many streams have a warm copy on a standby that a
// recovery could install now (checked against its source: warmcheck.go).
func (m *Manager) WarmCopies() int {
	m.warm.mu.Lock()
	defer m.warm.mu.Unlock()
	n := 0
	for _, c := range m.warm.copies {
		if c.usable() {
			n++
		}
	}
	return n
}

// usable says whether a recovery could install c now: its prompt's KV at
// least was checked equal to its source's (installBatch).
func (c *copyOf) usable() bool { return c.checked > 0 && c.checked >= c.prompt }

// WarmBytes is the KV bytes copied to warm standbys since start.
func (m *Manager) WarmBytes() int64 {
	m.warm.mu.Lock()
	defer m.warm.mu.Unlock()
	return m.warm.bytes
}

// WarmRecovered is how many recoveries installed a warm copy.
func (m *Manager) WarmRecovered() int {
	m.warm.mu.Lock()
	defer m.warm.mu.Unlock()
	return m.warm.used
}

// WarmDiffered is how many copies were dropped because they differed
// from their source's KV when checked (warmcheck.go).
func (m *Manager) WarmDiffered() int {
	m.warm.mu.Lock()
	defer m.warm.mu.Unlock()
	return m.warm.differed
}

// keepWarm runs one cycle of the warm standbys after a snapshot: copies
// whose stream ended, moved, or whose standby left are dropped; long
// streams without one get one; every pair's copies get a round.
func (m *Manager) keepWarm(ctx context.Context) {
	if m.cfg.WarmTokens <= 0 {
		return
	}
	instances := map[string]registry.Instance{}
	for _, in := range m.reg.List() {
		instances[in.ID] = in
	}
	usable := func(id string) bool {
		in, ok := instances[id]
		return ok && in.Lifecycle() == registry.LifecycleActive && in.Engine.Migratable
	}
	// No new copy onto or from an instance an operation holds (a
	// migration, a drain): a migration frees the copies its target holds
	// of the requests it moves and reserves them there, and a copy made
	// in between collided with its reservation.
	idle := func(id string) bool { return instances[id].Busy == (registry.Operation{}) }
	m.mu.Lock()
	states := make(map[string]hooks.RequestState, len(m.states))
	for id, st := range m.states {
		states[id] = st
	}
	m.mu.Unlock()

	// Drop what no longer holds.
	m.warm.mu.Lock()
	var stale []*copyOf
	for id, c := range m.warm.copies {
		s := m.streams.Get(id)
		if s == nil || s.Upstream() != c.src || !usable(c.dst) {
			stale = append(stale, c)
			delete(m.warm.copies, id)
		}
	}
	m.warm.mu.Unlock()
	m.release(ctx, stale, instances)

	// New copies: streams in decode whose context reached WarmTokens,
	// each to the survivor with the most free KV left.
	assigned := map[string]int{}
	var fresh []*copyOf
	for id, st := range states {
		total := len(st.PromptTokenIDs) + len(st.OutputTokenIDs)
		if total < m.cfg.WarmTokens || len(st.OutputTokenIDs) == 0 {
			continue
		}
		s := m.streams.Get(id)
		if s == nil {
			continue
		}
		// Upstream, not the field: the relay changes it under the
		// stream's lock as the stream moves or fails over.
		upstream := s.Upstream()
		if !usable(upstream) || !idle(upstream) {
			continue
		}
		m.warm.mu.Lock()
		_, has := m.warm.copies[id]
		m.warm.mu.Unlock()
		if has {
			continue
		}
		var best string
		bestFree := 0
		for _, in := range instances {
			if in.ID == upstream || !usable(in.ID) || !idle(in.ID) || !in.Serves(s.Model) {
				continue
			}
			if free := in.Stats.FreeBlocks - assigned[in.ID]; best == "" || free > bestFree {
				best, bestFree = in.ID, free
			}
		}
		if best == "" {
			continue
		}
		need := tokensNeeded(st)
		if g := instances[best].Engine.MaxModelLen; g > 0 {
			need = min(need, g)
		}
		if bs := instances[best].Engine.Geometry.BlockSize; bs > 0 {
			assigned[best] += (need + bs - 1) / bs
		}
		fresh = append(fresh, &copyOf{id: id, src: upstream, dst: best, prompt: len(st.PromptTokenIDs), needs: need})
	}

	// Group by pair; each pair's cycle runs on its own (pairs share no
	// engine's copy of a request, and a slow one must not hold the rest).
	byPair := map[[2]string][]*copyOf{}
	m.warm.mu.Lock()
	for _, c := range m.warm.copies {
		byPair[[2]string{c.src, c.dst}] = append(byPair[[2]string{c.src, c.dst}], c)
	}
	m.warm.mu.Unlock()
	newByPair := map[[2]string][]*copyOf{}
	for _, c := range fresh {
		newByPair[[2]string{c.src, c.dst}] = append(newByPair[[2]string{c.src, c.dst}], c)
	}
	var wg sync.WaitGroup
	for _, key := range pairKeys(byPair, newByPair) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m.warmPair(ctx, instances[key[0]], instances[key[1]], byPair[key], newByPair[key])
		}()
	}
	wg.Wait()
	if m.met != nil && m.met.WarmCopies != nil {
		m.met.WarmCopies.Set(float64(m.WarmCopies()))
	}
}

func pairKeys(a, b map[[2]string][]*copyOf) [][2]string {
	seen := map[[2]string]bool{}
	var out [][2]string
	for _, m := range []map[[2]string][]*copyOf{a, b} {
		for k := range m {
			if !seen[k] {
				seen[k] = true
				out = append(out, k)
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0]+out[i][1] < out[j][0]+out[j][1] })
	return out
}

// warmPair renews the pair's reservations, reserves the new copies, and
// runs the pair's rounds: incremental for the copies it has, full for the
// new ones.
func (m *Manager) warmPair(ctx context.Context, src, dst registry.Instance, have, fresh []*copyOf) {
	key := [2]string{src.ID, dst.ID}
	m.warm.mu.Lock()
	p := m.warm.pairs[key]
	if p == nil {
		p = &pairing{fresh: true}
		m.warm.pairs[key] = p
	}
	m.warm.mu.Unlock()
	rctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	p.mu.Lock()
	defer p.mu.Unlock()
	m.warm.mu.Lock()
	p.cancel = cancel // claim cancels the round to take a copy
	m.warm.mu.Unlock()
	defer func() {
		m.warm.mu.Lock()
		p.cancel = nil
		m.warm.mu.Unlock()
	}()
	log := m.log.With(zap.String("source", src.ID), zap.String("standby", dst.ID))
	sa, err := m.agents.Get(src.AgentAddress, src.TLS)
	if err != nil {
		return
	}
	da, err := m.agents.Get(dst.AgentAddress, dst.TLS)
	if err != nil {
		return
	}
	lease := m.warmLease()
	// Renew what the standby holds first, whatever the source answers: a
	// source that stopped answering is the one whose copies a failover
	// is about to need, and a renewal that waited on it let them lapse
	// when the failure took longer to establish than the lease (a
	// conformance run under load: 0 of 6 streams from their copies). A
	// copy whose reservation is gone (it expired: this Host was away)
	// starts over.
	if len(have) > 0 {
		items := make([]hooks.AllocateItem, len(have))
		for i, c := range have {
			items[i] = hooks.AllocateItem{RequestID: c.id}
		}
		ext, err := da.Engine.Allocate(rctx, hooks.AllocateRequest{Requests: items, LeaseMS: int(lease.Milliseconds()), Extend: true})
		if err != nil {
			log.Debug("warm standby: renewing its reservations failed", zap.Error(err))
			return
		}
		held := map[string]bool{}
		for _, it := range ext.Requests {
			held[it.RequestID] = true
		}
		kept := have[:0]
		for _, c := range have {
			if held[c.id] {
				kept = append(kept, c)
				continue
			}
			m.forget(c)
		}
		have = kept
	}
	// What each copy will cover once the rounds are done: the tokens
	// the source had output before they start, less the last (whose KV
	// its next step writes). Read before the new reservations: a request
	// whose state cannot move (structured output) gets no copy.
	list, err := sa.Engine.Requests(rctx)
	if err != nil {
		log.Debug("warm standby: listing the source's requests failed", zap.Error(err))
		return
	}
	tokens := make(map[string]int, len(list.Requests))
	for _, q := range list.Requests {
		if q.Status == hooks.StatusRunning && q.Unmovable == "" {
			tokens[q.RequestID] = q.NumPromptTokens + q.NumOutputTokens
		}
	}
	// Reserve the new ones, each alone: one the standby cannot take now
	// (no room) is left for a later cycle.
	for _, c := range fresh {
		if tokens[c.id] == 0 {
			continue
		}
		alloc, err := da.Engine.Allocate(rctx, hooks.AllocateRequest{Requests: []hooks.AllocateItem{{RequestID: c.id, NumTokens: c.needs}},
			LeaseMS: int(lease.Milliseconds())})
		if err != nil || len(alloc.Requests) != 1 || alloc.Requests[0].Recompute {
			log.Debug("warm standby: no reservation for a stream", zap.String("request_id", c.id), zap.Error(err))
			continue
		}
		c.blocks = &v1.RequestBlocks{RequestId: c.id, DstBlockIds: int32s(alloc.Requests[0].BlockIDs)}
		m.warm.mu.Lock()
		m.warm.copies[c.id] = c
		m.warm.mu.Unlock()
		have = append(have, c)
	}
	if len(have) == 0 {
		return
	}
	var blocks []int32
	for _, c := range have {
		blocks = append(blocks, c.blocks.DstBlockIds...)
	}
	var secret [32]byte
	_, _ = rand.Read(secret[:])
	session := "standby-" + hex.EncodeToString(secret[:6])
	pt, err := da.RPC.PrepareTarget(rctx, &v1.PrepareTargetRequest{MigrationId: session, Secret: secret[:], BlockIds: blocks, LeaseMs: lease.Milliseconds()})
	if err != nil {
		log.Debug("warm standby: preparing the standby failed", zap.Error(err))
		return
	}
	defer func() {
		cctx, ccancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_, _ = da.RPC.ReleaseTarget(cctx, &v1.ReleaseTargetRequest{MigrationId: session})
		ccancel()
	}()
	var dl hooks.Layout
	_ = json.Unmarshal(pt.GetLayout(), &dl)
	round := func(kind string, cs []*copyOf, since uint64) (*v1.CopyRoundResponse, error) {
		reqs := make([]*v1.RequestBlocks, len(cs))
		for i, c := range cs {
			reqs[i] = c.blocks
		}
		return sa.RPC.CopyRound(rctx, &v1.CopyRoundRequest{MigrationId: session, Kind: kind, SinceCursor: since, Requests: reqs,
			TargetDataAddress: pt.GetDataAddress(), TargetLayout: pt.GetLayout(), Secret: secret[:], TargetTls: dst.TLS, TargetRdma: pt.GetRdma(),
			InjectFault: m.cfg.InjectWarmFault})
	}
	// Copies that had a round take what their engine wrote since it;
	// new ones (and all of them after a lost cursor) everything.
	var incr, full []*copyOf
	for _, c := range have {
		if c.covered > 0 && !p.fresh {
			incr = append(incr, c)
		} else {
			full = append(full, c)
		}
	}
	// A round copies again whole the blocks written since the last one,
	// the block of the first unchecked position among them: until the
	// check after the rounds, only the blocks before it count as checked
	// (a recovery claiming the pair meanwhile installs no more than that).
	if bs := dl.Geometry.BlockSize; bs > 0 {
		m.warm.mu.Lock()
		for _, c := range have {
			c.checked -= c.checked % bs
		}
		m.warm.mu.Unlock()
	}
	cursor := uint64(0)
	for _, r := range []struct {
		kind string
		cs   []*copyOf
	}{{transfer.KindIncremental, incr}, {transfer.KindFull, full}} {
		if len(r.cs) == 0 {
			continue
		}
		resp, err := round(r.kind, r.cs, p.cursor)
		if err != nil {
			log.Debug("warm standby: a round failed", zap.String("kind", r.kind), zap.Int("streams", len(r.cs)), zap.Error(err))
			return
		}
		if cursor == 0 || resp.GetCursor() < cursor {
			cursor = resp.GetCursor() // the older of the two: what the next round must copy from
		}
		dropped := map[string]bool{}
		for _, id := range resp.GetDroppedRequestIds() {
			dropped[id] = true
		}
		bySrc := map[string]*v1.RequestBlocks{}
		for _, rb := range resp.GetRequests() {
			bySrc[rb.GetRequestId()] = rb
		}
		m.warm.mu.Lock()
		m.warm.bytes += resp.GetBytes()
		if m.met != nil && m.met.WarmBytes != nil {
			m.met.WarmBytes.Add(float64(resp.GetBytes()))
		}
		for _, c := range r.cs {
			if dropped[c.id] {
				continue // ended on the source: the next cycle drops it
			}
			if rb := bySrc[c.id]; rb != nil {
				c.blocks.SrcBlockIds = rb.GetSrcBlockIds()
			}
			if n := tokens[c.id]; n > c.prompt {
				c.covered = n - 1
			}
		}
		m.warm.mu.Unlock()
	}
	p.cursor, p.fresh = cursor, false
	differ, err := m.checkWarm(rctx, sa, da, session, dl, have)
	if err != nil {
		// Unchecked, nothing is dropped: the next cycle checks the
		// same positions and those since.
		log.Debug("warm standby: checking the copies failed", zap.Error(err))
	}
	if len(differ) > 0 {
		for _, c := range differ {
			m.forget(c)
		}
		m.release(context.WithoutCancel(ctx), differ, map[string]registry.Instance{dst.ID: dst})
		m.warm.mu.Lock()
		m.warm.differed += len(differ)
		m.warm.mu.Unlock()
		if m.met != nil && m.met.WarmDiffer != nil {
			m.met.WarmDiffer.Add(float64(len(differ)))
		}
	}
	log.Debug("warm standby: copies refreshed", zap.Int("incremental", len(incr)), zap.Int("full", len(full)), zap.Uint64("cursor", cursor))
}

// forget drops c from the copies (its reservation is gone or released).
func (m *Manager) forget(c *copyOf) {
	m.warm.mu.Lock()
	if m.warm.copies[c.id] == c {
		delete(m.warm.copies, c.id)
	}
	m.warm.mu.Unlock()
}

// release frees the standbys' reservations of copies no longer kept
// (ReservedOnly: a request the standby runs — a recovery or a migration
// installed it there — stays).
func (m *Manager) release(ctx context.Context, cs []*copyOf, instances map[string]registry.Instance) {
	byDst := map[string][]string{}
	for _, c := range cs {
		byDst[c.dst] = append(byDst[c.dst], c.id)
	}
	for dst, ids := range byDst {
		in, ok := instances[dst]
		if !ok || !in.Reachable {
			continue // it frees them itself when their lease ends
		}
		a, err := m.agents.Get(in.AgentAddress, in.TLS)
		if err != nil {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
		_, err = a.Engine.Abort(cctx, hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true, ReservedOnly: true})
		cancel()
		if err != nil {
			m.log.Debug("warm standby: releasing copies failed", zap.String("standby", dst), zap.Error(err))
		}
	}
}

// ReleaseCopies frees the warm copies of ids held on instance: a
// migration is about to reserve those requests there.
func (m *Manager) ReleaseCopies(ctx context.Context, instance string, ids []string) {
	// A pair's cycle in flight may be reserving a new copy of one of ids
	// as this runs: the claim waits for it, and the next pass frees what
	// it made. (No cycle starts a copy onto or from an instance that an
	// operation holds: keepWarm.)
	for pass := 0; pass < 3; pass++ {
		var cs []*copyOf
		m.warm.mu.Lock()
		for _, id := range ids {
			if c := m.warm.copies[id]; c != nil && c.dst == instance {
				cs = append(cs, c)
			}
		}
		m.warm.mu.Unlock()
		if len(cs) == 0 {
			return
		}
		var claimed []*copyOf
		byPair := map[[2]string][]*copyOf{}
		for _, c := range cs {
			byPair[[2]string{c.src, c.dst}] = append(byPair[[2]string{c.src, c.dst}], c)
		}
		for _, pc := range byPair {
			m.claim(ctx, pc, func(mine []*copyOf) { claimed = append(claimed, mine...) })
		}
		if in, err := m.reg.Get(instance); err == nil && len(claimed) > 0 {
			m.release(ctx, claimed, map[string]registry.Instance{instance: in})
		}
	}
}

// claim takes copies cs (all of one pair) out of the standbys for use:
// the pair's round in flight is cancelled and waited for (its writes must
// end before the blocks change hands), then use runs with the pair held,
// given those of cs not taken already. False: ctx ended first (the copies
// are out of the standbys all the same; their reservations end with
// their lease or a release).
func (m *Manager) claim(ctx context.Context, cs []*copyOf, use func([]*copyOf)) bool {
	if len(cs) == 0 {
		return true
	}
	m.warm.mu.Lock()
	p := m.warm.pairs[[2]string{cs[0].src, cs[0].dst}]
	var mine []*copyOf
	for _, c := range cs {
		if m.warm.copies[c.id] == c {
			delete(m.warm.copies, c.id)
			mine = append(mine, c)
		}
	}
	var cancel context.CancelFunc
	if p != nil {
		cancel = p.cancel
	}
	m.warm.mu.Unlock()
	if p != nil {
		if cancel != nil {
			cancel()
		}
		locked := make(chan struct{})
		go func() { p.mu.Lock(); close(locked) }()
		select {
		case <-locked:
			defer p.mu.Unlock()
		case <-ctx.Done():
			go func() { <-locked; p.mu.Unlock() }()
			return false
		}
	}
	use(mine)
	return true
}

// A dead engine's streams break together and reach installWarm each on
// its own goroutine: those with copies on one standby are installed there
// in one call (one claim of the pair, one install), once all of the
// pair's copies asked or the gather window passed.

// warmWaiter is one stream waiting for its batch's install.
type warmWaiter struct {
	c     *copyOf
	state hooks.RequestState
	done  chan bool // buffered
}

// warmBatch gathers one pair's recoveries.
type warmBatch struct {
	list   []*warmWaiter
	expect int           // the pair's copies when the batch began
	full   chan struct{} // closed when list reaches expect
}

// installWarm installs state (the client's tokens) on the standby holding
// stream sid's warm copy, computed up to what the copy covers: the
// standby computes the tokens since and goes on. ok false: no usable copy
// (the caller recomputes; a copy that could not be used is released, so
// that the recompute can reserve the request there).
func (m *Manager) installWarm(ctx context.Context, sid, from string, state hooks.RequestState) (url, id string, ok bool) {
	m.warm.mu.Lock()
	c := m.warm.copies[sid]
	m.warm.mu.Unlock()
	if c == nil {
		return "", "", false
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	dst, err := m.reg.Get(c.dst)
	if err != nil {
		m.forget(c)
		return "", "", false
	}
	if c.src != from || dst.Lifecycle() != registry.LifecycleActive {
		// A copy of another life of the stream, or on an instance that
		// cannot take it now.
		m.claim(ctx, []*copyOf{c}, func(cs []*copyOf) { m.release(ctx, cs, map[string]registry.Instance{dst.ID: dst}) })
		return "", "", false
	}
	w := &warmWaiter{c: c, state: state, done: make(chan bool, 1)}
	key := [2]string{c.src, c.dst}
	m.warm.mu.Lock()
	b := m.warm.batches[key]
	first := b == nil
	if first {
		b = &warmBatch{full: make(chan struct{})}
		for _, o := range m.warm.copies {
			if o.src == c.src && o.dst == c.dst {
				b.expect++
			}
		}
		m.warm.batches[key] = b
	}
	b.list = append(b.list, w)
	if len(b.list) == b.expect {
		close(b.full)
	}
	m.warm.mu.Unlock()
	if first {
		began := time.Now()
		go func() {
			t := time.NewTimer(m.cfg.GatherWindow)
			select {
			case <-b.full:
			case <-t.C:
			}
			t.Stop()
			m.warm.mu.Lock()
			delete(m.warm.batches, key)
			list := b.list
			m.warm.mu.Unlock()
			m.installBatch(context.WithoutCancel(ctx), dst, list, began)
		}()
	}
	select {
	case ok = <-w.done:
	case <-ctx.Done():
		return "", "", false
	}
	if !ok {
		return "", "", false
	}
	return dst.Engine.URL, dst.ID, true
}

// installBatch installs one pair's waiting recoveries on its standby in
// one call, and answers each waiter.
func (m *Manager) installBatch(ctx context.Context, dst registry.Instance, list []*warmWaiter, began time.Time) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	answered := map[*warmWaiter]bool{}
	answer := func(w *warmWaiter, ok bool) {
		if !answered[w] {
			answered[w] = true
			w.done <- ok
		}
	}
	defer func() {
		for _, w := range list {
			answer(w, false)
		}
	}()
	byCopy := map[*copyOf]*warmWaiter{}
	cs := make([]*copyOf, len(list))
	for i, w := range list {
		cs[i], byCopy[w.c] = w.c, w
	}
	var installErr error
	m.claim(ctx, cs, func(mine []*copyOf) {
		claimed := time.Now()
		a, err := m.agents.Get(dst.AgentAddress, dst.TLS)
		if err != nil {
			installErr = err
			return
		}
		var states []hooks.RequestState
		var ids, unusable []string
		var ws []*warmWaiter
		computed := 0
		for _, c := range mine {
			w := byCopy[c]
			st := w.state
			total := len(st.PromptTokenIDs) + len(st.OutputTokenIDs)
			// Only what was checked equal to the source's KV (warmcheck.go)
			// is installed; the rest is computed again.
			st.NumComputedTokens = min(c.checked, total-1)
			if st.NumComputedTokens < c.prompt {
				unusable = append(unusable, c.id) // no round checked yet
				continue
			}
			states, ids, ws = append(states, st), append(ids, c.id), append(ws, w)
			computed += st.NumComputedTokens
		}
		if len(unusable) > 0 {
			_, _ = a.Engine.Abort(ctx, hooks.AbortRequest{RequestIDs: unusable, Silent: true, IgnoreMissing: true, ReservedOnly: true})
		}
		if len(states) == 0 {
			return
		}
		if _, err := a.Engine.Install(ctx, hooks.InstallRequest{Requests: states, Resume: true}); err != nil {
			installErr = err
			_, _ = a.Engine.Abort(context.WithoutCancel(ctx), hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true, ReservedOnly: true})
			return
		}
		for _, w := range ws {
			answer(w, true)
		}
		if m.met != nil && m.met.WarmTokens != nil {
			m.met.WarmTokens.Add(float64(computed))
		}
		m.warm.mu.Lock()
		m.warm.used += len(ws)
		m.warm.mu.Unlock()
		m.log.Info("streams recovered from their warm copies", zap.String("standby", dst.ID), zap.Int("streams", len(ws)),
			zap.Int("tokens_installed", computed), zap.Int("unusable", len(unusable)), zap.Duration("gathered", start.Sub(began)),
			zap.Duration("claimed", claimed.Sub(start)), zap.Duration("installed", time.Since(claimed)))
	})
	if installErr != nil {
		m.log.Info("warm copies could not be installed; recomputing", zap.String("standby", dst.ID), zap.Int("streams", len(list)), zap.Error(installErr))
	}
}

func int32s(v []int) []int32 {
	out := make([]int32, len(v))
	for i, x := range v {
		out[i] = int32(x)
	}
	return out
}

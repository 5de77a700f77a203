package migrate

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/kvsum"
	"github.com/vllm-hi/vllm-hi/internal/transfer"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// The check that the target holds what the source held runs in two
// parts. Both agents hash KV slots in their engines' memory as it is at
// that moment, each in a canonical order (global layer, K/V, global head,
// slot) that does not depend on either engine's TP/PP shape, and the Host
// compares. A stale mapping, a copy bug or a write by someone else shows
// up as a difference, and the migration aborts before the commit.
//
//   - verifyCopied runs after the last incremental round, before the
//     pause, while the source decodes: it checks tokens that can no
//     longer change and are already on the target — every token before
//     the first one written after the last round's cursor (slots are
//     written once, in order). Full mode checks all of them; sample mode
//     the block the next tokens go into and a few random full blocks per
//     request. This costs no downtime.
//   - verify runs in the pause after the final round and checks the rest:
//     each request's tokens from that boundary to its last computed one
//     (a few per request: what the final round moved).
//
// An engine whose blocks are opaque (vLLM CPU: the final round copies
// whole blocks) is checked in whole blocks on both sides.

// checkCopied is the check before the pause, as a step of its own, and
// the catch-up after it. It returns the cursor the final round copies
// from.
func (m *migration) checkCopied(ctx context.Context, since uint64) (uint64, error) {
	if m.o.cfg.Verify == hostapi.VerifyOff {
		return since, m.verifyCopied(ctx, since)
	}
	if err := m.enter(ctx, stepCopyCheck); err != nil {
		return since, err
	}
	start := time.Now()
	if err := m.verifyCopied(ctx, since); err != nil {
		return since, err
	}
	return m.catchUp(ctx, since, time.Since(start))
}

// catchUp copies what the source wrote while the check ran, and checks
// it, for as long as the check outlasted a copy round (Config.
// CatchUpRounds, CatchUpRatio). At the seed's load on the H200 the check
// took 2.8–3.6 s against 0.1–0.2 s a round; the final round then moved
// 2,700–3,200 blocks, eight times an incremental round, and the check in
// the pause read them all (1.2–1.3 s). A catch-up shrinks the pause's
// backlog only while its check takes less than the time the source took
// to write what it checks: at that load the source wrote ~2.5 GB/s of KV
// and a check read ~2.9 GB/s a side, so a catch-up's check samples in
// sample mode (verifyCopied) rather than reading every new token.
func (m *migration) catchUp(ctx context.Context, since uint64, checked time.Duration) (uint64, error) {
	for i := 0; i < m.o.cfg.CatchUpRounds && checked > time.Duration(m.o.cfg.CatchUpRatio*float64(m.lastRound())); i++ {
		if err := ctx.Err(); err != nil {
			return since, m.interrupted(ctx, "catch-up round")
		}
		r, err := m.copyRound(ctx, roundIncremental, since, false, "")
		if err != nil {
			return since, fmt.Errorf("catch-up: %w", err)
		}
		since = r.GetCursor()
		start := time.Now()
		if err := m.verifyCopied(ctx, since); err != nil {
			return since, err
		}
		checked = time.Since(start)
	}
	return since, nil
}

// lastRound is how long the last copy round took.
func (m *migration) lastRound() time.Duration {
	m.mu.Lock()
	defer m.mu.Unlock()
	if n := len(m.st.Rounds); n > 0 {
		return time.Duration(m.st.Rounds[n-1].DurationS * float64(time.Second))
	}
	return 0
}

// verifyCopied checks the stable tokens (see above) and remembers, per
// request, where they end. since is the cursor the last round copied up
// to. A second call would check every token from the first one's
// boundary on.
func (m *migration) verifyCopied(ctx context.Context, since uint64) error {
	mode := m.o.cfg.Verify
	m.mu.Lock()
	prev := m.stableTokens
	m.stableTokens = map[string]int{}
	m.mu.Unlock()
	if mode == hostapi.VerifyOff {
		m.setVerification(hostapi.Verification{Mode: mode})
		return nil
	}
	bs := m.srcLayout.Geometry.BlockSize
	cctx, cancel := m.call(ctx)
	list, err := m.srcA.Engine.Requests(cctx)
	var ch hooks.Changes
	if err == nil {
		ch, err = m.srcA.Engine.Changes(cctx, since)
	}
	cancel()
	if err != nil {
		return fmt.Errorf("integrity check: read the source's requests and changes: %w", err)
	}
	// The boundary: the tokens computed when the list was read, or the
	// first slot written after the last round's cursor, whichever is
	// earlier (writes after the list was read come later still).
	boundary := map[string]int{}
	tables := map[string][]int{}
	for _, r := range list.Requests {
		boundary[r.RequestID] = r.NumComputedTokens
		tables[r.RequestID] = r.BlockIDs
	}
	for _, w := range ch.Written {
		for i, b := range tables[w.RequestID] {
			if b == w.Block {
				boundary[w.RequestID] = min(boundary[w.RequestID], i*bs+w.FirstSlot)
				break
			}
		}
	}
	opaque := m.srcLayout.OpaqueBlocks || m.dstOpaque
	var src, dst []*v1.BlockSlots
	var at []blockAt
	m.mu.Lock()
	for id, rb := range m.moving {
		if m.recompute[id] {
			continue // its KV does not move: the target computes it
		}
		b := boundary[id]
		b = min(b, len(rb.SrcBlockIds)*bs, len(rb.DstBlockIds)*bs)
		if opaque {
			b -= b % bs
		}
		m.stableTokens[id] = b
		if from, again := prev[id]; again {
			// A catch-up's check: the tokens that became stable since the
			// last one — all of them in full mode; in sample mode as the
			// first check samples, the blocks at both ends of the range
			// and a few random ones between. Checking every new token
			// (2.5 GB/s of KV at the seed's load on the H200) would take
			// longer than the source takes to write as much again, and
			// the catch-up would not converge.
			s, d, w := tokenRange(rb, id, from, b, bs)
			if mode != hostapi.VerifyFull {
				s, d, w = sampleRange(s, d, w, m.o.cfg.VerifySamples)
			}
			src, dst, at = append(src, s...), append(dst, d...), append(at, w...)
			continue
		}
		full := b / bs
		var picks []int
		if mode == hostapi.VerifyFull {
			picks = pick(full, full)
		} else {
			picks = pick(full, m.o.cfg.VerifySamples)
		}
		for _, i := range picks {
			src = append(src, &v1.BlockSlots{Block: rb.SrcBlockIds[i], NumSlots: int32(bs)})
			dst = append(dst, &v1.BlockSlots{Block: rb.DstBlockIds[i], NumSlots: int32(bs)})
			at = append(at, blockAt{id, i})
		}
		if part := b % bs; part > 0 { // where the next tokens go
			src = append(src, &v1.BlockSlots{Block: rb.SrcBlockIds[full], NumSlots: int32(part)})
			dst = append(dst, &v1.BlockSlots{Block: rb.DstBlockIds[full], NumSlots: int32(part)})
			at = append(at, blockAt{id, full})
		}
	}
	m.mu.Unlock()
	src, dst, at = onceEach(src, dst, at)
	v, diff, err := m.compare(ctx, src, dst, at)
	if err == nil {
		err = m.judge(ctx, src, dst, at, diff)
	}
	m.mu.Lock()
	if m.st.Verification == nil {
		m.st.Verification = &hostapi.Verification{Mode: mode}
	}
	m.st.Verification.Blocks += v.Blocks
	m.st.Verification.Bytes += v.Bytes
	m.st.Verification.DurationS += v.DurationS
	m.mu.Unlock()
	return err
}

// tokenRange lists the slots of tokens [from, to) of a request, block by
// block, on both sides.
func tokenRange(rb *v1.RequestBlocks, id string, from, to, bs int) (src, dst []*v1.BlockSlots, at []blockAt) {
	for t := from; t < to; {
		i, first := t/bs, t%bs
		n := min(bs-first, to-t)
		src = append(src, &v1.BlockSlots{Block: rb.SrcBlockIds[i], FirstSlot: int32(first), NumSlots: int32(n)})
		dst = append(dst, &v1.BlockSlots{Block: rb.DstBlockIds[i], FirstSlot: int32(first), NumSlots: int32(n)})
		at = append(at, blockAt{id, i})
		t += n
	}
	return src, dst, at
}

// verify checks, in the pause, every moved request's tokens from its
// stable boundary to its last computed one.
func (m *migration) verify(ctx context.Context, states []movedState) error {
	if m.o.cfg.Verify == hostapi.VerifyOff || len(states) == 0 {
		return nil
	}
	bs := m.srcLayout.Geometry.BlockSize
	var src, dst []*v1.BlockSlots
	var at []blockAt
	m.mu.Lock()
	for _, st := range states {
		rb := m.moving[st.RequestID]
		nc := st.NumComputedTokens
		if rb == nil || nc <= 0 || m.recompute[st.RequestID] {
			continue
		}
		k := (nc + bs - 1) / bs
		if k > len(rb.SrcBlockIds) || k > len(rb.DstBlockIds) {
			m.mu.Unlock()
			return fmt.Errorf("integrity check: request %s has %d computed tokens but %d source and %d target blocks", st.RequestID, nc, len(rb.SrcBlockIds), len(rb.DstBlockIds))
		}
		from, ok := m.stableTokens[st.RequestID]
		if !ok || from > nc {
			from = max(0, (k-2)*bs) // not seen before the pause: its last two blocks
		}
		s, d, w := tokenRange(rb, st.RequestID, from, nc, bs)
		src, dst, at = append(src, s...), append(dst, d...), append(at, w...)
	}
	m.mu.Unlock()
	v, diff, err := m.compare(ctx, src, dst, at)
	if err == nil {
		// A paused request still ends when its client leaves, and the
		// source may hand its blocks to a request it still runs (one
		// not moving): such a request is left behind here too.
		err = m.judge(ctx, src, dst, at, diff)
	}
	m.mu.Lock()
	if m.st.Verification == nil {
		m.st.Verification = &hostapi.Verification{Mode: m.o.cfg.Verify}
	}
	m.st.Verification.Blocks += v.Blocks
	m.st.Verification.Bytes += v.Bytes
	m.st.Verification.DurationS += v.DurationS
	m.st.Verification.PauseDurationS = v.DurationS
	m.mu.Unlock()
	return err
}

func (m *migration) setVerification(v hostapi.Verification) {
	m.mu.Lock()
	m.st.Verification = &v
	m.mu.Unlock()
}

// blockAt names a checked block: request and index in its block table.
type blockAt struct {
	request string
	index   int
}

// compare has both agents hash their blocks at once and returns the
// indices of the blocks whose hashes differ.
func (m *migration) compare(ctx context.Context, src, dst []*v1.BlockSlots, at []blockAt) (hostapi.Verification, []int, error) {
	var v hostapi.Verification
	if len(src) == 0 {
		return v, nil, nil
	}
	start := time.Now()
	type answer struct {
		r   *v1.HashBlocksResponse
		err error
	}
	ask := func(scheme string) (answer, answer) {
		srcC, dstC := make(chan answer, 1), make(chan answer, 1)
		go func() {
			r, err := m.srcA.RPC.HashBlocks(ctx, &v1.HashBlocksRequest{MigrationId: m.st.ID, Blocks: src, Scheme: scheme})
			srcC <- answer{r, err}
		}()
		go func() {
			r, err := m.dstA.RPC.HashBlocks(ctx, &v1.HashBlocksRequest{MigrationId: m.st.ID, Blocks: dst, Scheme: scheme})
			dstC <- answer{r, err}
		}()
		return <-srcC, <-dstC
	}
	// GPU KV is hashed in place on the GPU with the kvsum scheme (one
	// kernel launch a side, instead of a gather into host memory and a
	// hash on the CPU: 50–70 ms a side in the pause on the H100). Where
	// either agent answers in another scheme (an older agent, a layout
	// the kernel cannot read), both are asked again in xxhash64, which
	// every agent serves, and so are the migration's later checks (the
	// one inside the pause then hashes once).
	scheme := ""
	m.mu.Lock()
	if (transfer.OnGPU(m.srcLayout) || m.dstOnGPU) && !m.noKVSum {
		scheme = kvsum.Scheme
	}
	m.mu.Unlock()
	a, b := ask(scheme)
	if scheme != "" && a.err == nil && b.err == nil && (a.r.GetScheme() != scheme || b.r.GetScheme() != scheme) {
		m.log.Info("integrity check: an agent did not hash in the scheme asked for; both hash in xxhash64 from now on",
			zap.String("asked", scheme), zap.String("source", a.r.GetScheme()), zap.String("target", b.r.GetScheme()))
		m.mu.Lock()
		m.noKVSum = true
		m.mu.Unlock()
		a, b = ask("")
	}
	switch {
	case a.err != nil:
		return v, nil, fmt.Errorf("integrity check: hash the source's blocks: %w", a.err)
	case b.err != nil:
		return v, nil, fmt.Errorf("integrity check: hash the target's blocks: %w", b.err)
	case len(a.r.GetHashes()) != len(src) || len(b.r.GetHashes()) != len(dst):
		return v, nil, fmt.Errorf("integrity check: %d and %d hashes for %d blocks", len(a.r.GetHashes()), len(b.r.GetHashes()), len(src))
	}
	v.Blocks, v.Bytes, v.DurationS = len(src), a.r.GetBytes(), time.Since(start).Seconds()
	var diff []int
	for i := range src {
		if a.r.GetHashes()[i] != b.r.GetHashes()[i] {
			diff = append(diff, i)
		}
	}
	return v, diff, nil
}

// judge turns the blocks that differ (compare) into the check's verdict.
// The source decodes on beside the check (before the pause all its
// requests, in it those not moving): a request that ends meanwhile (its
// last token, or its client left, paused or not) frees its blocks, and
// the source may hand them to another request and write them before its
// side is hashed. Its blocks then differ with nothing copied wrong (vLLM
// at a near-full KV pool: the H100's cut load, 2026-12-06, about one in
// twelve of the requests ending during the migration). Such a request
// moves nowhere anyway: the source's requests are read again after the
// hashes, and a differing block whose request the source no longer holds
// with that block at that place is left behind with its request. A
// request it still holds with it held it all through the hash, so its
// difference is data loss.
func (m *migration) judge(ctx context.Context, src, dst []*v1.BlockSlots, at []blockAt, diff []int) error {
	if len(diff) == 0 {
		return nil
	}
	ended, err := m.endedDuringCheck(ctx, src, at, diff)
	if err != nil {
		m.log.Warn("integrity check: could not read the source's requests again to tell a request that ended from a difference", zap.Error(err))
	}
	if len(ended) > 0 {
		diff = slices.DeleteFunc(diff, func(i int) bool { return ended[at[i].request] })
		ids := slices.Sorted(maps.Keys(ended))
		m.log.Info("integrity check: requests that ended during the check are left behind (their blocks were freed and may hold other bytes)", zap.Strings("request_ids", ids))
		m.drop(ids...)
	}
	if len(diff) == 0 {
		return nil
	}
	first := diff[0]
	w := at[first]
	m.logDifferences(src, dst, at, diff)
	// Only a check that found a difference is data loss (not one that
	// could not be made): the metric counts these.
	return errdefs.Newf(errdefs.ErrDataLoss, "integrity check failed: the target does not hold what the source held (%d of %d blocks checked differ; first: block %d of request %s, slots [%d, %d), source block %d, target block %d)",
		len(diff), len(src), w.index, w.request, src[first].GetFirstSlot(), src[first].GetFirstSlot()+src[first].GetNumSlots(), src[first].GetBlock(), dst[first].GetBlock())
}

// endedDuringCheck names the requests of the differing blocks that the
// source no longer holds (running or paused) with the checked block at
// its place.
func (m *migration) endedDuringCheck(ctx context.Context, src []*v1.BlockSlots, at []blockAt, diff []int) (map[string]bool, error) {
	cctx, cancel := m.call(ctx)
	list, err := m.srcA.Engine.Requests(cctx)
	cancel()
	if err != nil {
		return nil, err
	}
	// Paused or not: a request the source still holds with that block at
	// that place (a paused one is still the source's, its blocks kept).
	tables := map[string][]int{}
	for _, r := range list.Requests {
		tables[r.RequestID] = r.BlockIDs
	}
	ended := map[string]bool{}
	for _, i := range diff {
		w := at[i]
		table, ok := tables[w.request]
		if !ok || w.index >= len(table) || table[w.index] != int(src[i].GetBlock()) {
			ended[w.request] = true
		}
	}
	return ended, nil
}

// logDifferences says, for the first few blocks that differ, where they
// are in their request (the last block, where the next tokens go, or an
// earlier one) and whether another moving request's table holds the same
// source block (a prefix shared through the engine's prefix cache): what
// tells a copy that missed a write from one that read a block too early.
func (m *migration) logDifferences(src, dst []*v1.BlockSlots, at []blockAt, diff []int) {
	m.mu.Lock()
	holders := map[int32]int{}
	tableLen := map[string]int{}
	for id, rb := range m.moving {
		tableLen[id] = len(rb.SrcBlockIds)
		for _, b := range rb.SrcBlockIds {
			holders[b]++
		}
	}
	stable := maps.Clone(m.stableTokens)
	m.mu.Unlock()
	const most = 8
	for _, i := range diff[:min(len(diff), most)] {
		w := at[i]
		m.log.Warn("integrity check: a block differs",
			zap.String("request", w.request), zap.Int("index", w.index), zap.Int("table_blocks", tableLen[w.request]),
			zap.Int("stable_tokens", stable[w.request]),
			zap.Int32("first_slot", src[i].GetFirstSlot()), zap.Int32("num_slots", src[i].GetNumSlots()),
			zap.Int32("src_block", src[i].GetBlock()), zap.Int32("dst_block", dst[i].GetBlock()),
			zap.Int("moving_requests_holding_the_src_block", holders[src[i].GetBlock()]))
	}
}

// sampleRange keeps, of a token range's blocks (tokenRange), the first,
// the last and n random ones between.
func sampleRange[S, D, W any](src []S, dst []D, at []W, n int) ([]S, []D, []W) {
	k := len(src)
	if k <= n+2 {
		return src, dst, at
	}
	keep := []int{0, k - 1}
	for _, i := range pick(k-2, n) {
		keep = append(keep, i+1)
	}
	slices.Sort(keep)
	s, d, w := make([]S, 0, len(keep)), make([]D, 0, len(keep)), make([]W, 0, len(keep))
	for _, i := range keep {
		s, d, w = append(s, src[i]), append(d, dst[i]), append(w, at[i])
	}
	return s, d, w
}

// pick chooses up to n of k block indices at random (all when n ≥ k).
func pick(k, n int) []int {
	if n >= k {
		out := make([]int, k)
		for i := range out {
			out[i] = i
		}
		return out
	}
	out := make([]int, 0, n)
	seen := map[int]bool{}
	for len(out) < n {
		if i := rand.IntN(k); !seen[i] {
			seen[i] = true
			out = append(out, i)
		}
	}
	return out
}

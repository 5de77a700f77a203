package migrate

import (
	"context"
	"fmt"
	"math/rand/v2"
	"time"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
)

// verify checks, before the commit, that the target holds what the source
// held: both agents hash the moved requests' blocks in their engine's
// memory as it is now (the source's requests are paused, the target's
// writes have landed), in a canonical order that does not depend on
// either engine's TP/PP shape, and the Host compares. Sample mode hashes
// every request's last two blocks — where the final round wrote — and a
// few random others chosen now, so no copy bug or stale mapping can know
// which; full mode hashes every block. Only the computed slots of a
// partial block count (the rest may differ legitimately).
func (m *migration) verify(ctx context.Context, states []movedState) error {
	mode := m.o.cfg.Verify
	v := &Verification{Mode: mode}
	defer func() {
		m.mu.Lock()
		m.st.Verification = v
		m.mu.Unlock()
	}()
	if mode == VerifyOff || len(states) == 0 {
		return nil
	}
	start := time.Now()
	bs := m.srcLayout.Geometry.BlockSize
	var src, dst []*v1.BlockSlots
	type where struct {
		request string
		index   int
	}
	var at []where
	m.mu.Lock()
	for _, st := range states {
		rb := m.moving[st.RequestID]
		nc := st.NumComputedTokens
		if rb == nil || nc <= 0 {
			continue
		}
		k := (nc + bs - 1) / bs
		if k > len(rb.SrcBlockIds) || k > len(rb.DstBlockIds) {
			m.mu.Unlock()
			return fmt.Errorf("integrity check: request %s has %d computed tokens but %d source and %d target blocks", st.RequestID, nc, len(rb.SrcBlockIds), len(rb.DstBlockIds))
		}
		for _, i := range pick(k, mode, m.o.cfg.VerifySamples) {
			n := bs
			if i == k-1 {
				n = nc - (k-1)*bs
			}
			src = append(src, &v1.BlockSlots{Block: rb.SrcBlockIds[i], NumSlots: int32(n)})
			dst = append(dst, &v1.BlockSlots{Block: rb.DstBlockIds[i], NumSlots: int32(n)})
			at = append(at, where{st.RequestID, i})
		}
	}
	m.mu.Unlock()
	if len(src) == 0 {
		return nil
	}
	type answer struct {
		r   *v1.HashBlocksResponse
		err error
	}
	srcC, dstC := make(chan answer, 1), make(chan answer, 1)
	go func() {
		r, err := m.srcA.HashBlocks(ctx, &v1.HashBlocksRequest{MigrationId: m.st.ID, Blocks: src})
		srcC <- answer{r, err}
	}()
	go func() {
		r, err := m.dstA.HashBlocks(ctx, &v1.HashBlocksRequest{MigrationId: m.st.ID, Blocks: dst})
		dstC <- answer{r, err}
	}()
	a, b := <-srcC, <-dstC
	switch {
	case a.err != nil:
		return fmt.Errorf("integrity check: hash the source's blocks: %w", rpcError(a.err))
	case b.err != nil:
		return fmt.Errorf("integrity check: hash the target's blocks: %w", rpcError(b.err))
	case len(a.r.GetHashes()) != len(src) || len(b.r.GetHashes()) != len(dst):
		return fmt.Errorf("integrity check: %d and %d hashes for %d blocks", len(a.r.GetHashes()), len(b.r.GetHashes()), len(src))
	}
	v.Blocks, v.Bytes, v.DurationS = len(src), a.r.GetBytes(), time.Since(start).Seconds()
	bad, first := 0, -1
	for i := range src {
		if a.r.GetHashes()[i] != b.r.GetHashes()[i] {
			bad++
			if first < 0 {
				first = i
			}
		}
	}
	if bad > 0 {
		w := at[first]
		return fmt.Errorf("integrity check failed: the target does not hold what the source held (%d of %d blocks checked differ; first: block %d of request %s, source block %d, target block %d)",
			bad, len(src), w.index, w.request, src[first].GetBlock(), dst[first].GetBlock())
	}
	return nil
}

// pick chooses which of a request's k blocks to check.
func pick(k int, mode string, samples int) []int {
	if mode == VerifyFull || k <= 2+samples {
		out := make([]int, k)
		for i := range out {
			out[i] = i
		}
		return out
	}
	out := []int{k - 1, k - 2}
	seen := map[int]bool{k - 1: true, k - 2: true}
	for len(out) < 2+samples {
		i := rand.IntN(k - 2)
		if !seen[i] {
			seen[i] = true
			out = append(out, i)
		}
	}
	return out
}

package failover

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/kvsum"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// A warm copy is installed when its source is dead, so nothing can check
// it then against what the source held. It is checked while the source
// lives instead: after each round both agents hash the positions that
// became covered since the last check (they are written once, in order,
// and no longer change) from the start of their block (which the round
// copied again whole), and a copy whose hashes differ is dropped — its
// stream's failover recomputes it rather than install what the source
// never held. Where blocks are opaque (vLLM's CPU layout: a check takes a
// block whole) only the blocks that filled are checked, as a migration's
// check before the pause does.

// warmRange is the part of one copy a check hashes.
type warmRange struct {
	c        *copyOf
	from, to int // positions [from, to)
}

// checkWarm hashes ranges of the copies just refreshed on the source
// (through sa) and the standby (da, whose layout is dl) in session and
// returns the copies whose hashes differ. The copies' checked marks move
// to what was found equal.
func (m *Manager) checkWarm(ctx context.Context, sa, da agentclient.Agent, session string, dl hooks.Layout, cs []*copyOf) ([]*copyOf, error) {
	bs := dl.Geometry.BlockSize
	if bs < 1 {
		return nil, fmt.Errorf("the standby's layout has no block size")
	}
	var ranges []warmRange
	var src, dst []*v1.BlockSlots
	var owner []int // index into ranges of each hashed block
	m.warm.mu.Lock()
	for _, c := range cs {
		to := c.covered
		if dl.OpaqueBlocks {
			to -= to % bs
		}
		to = min(to, len(c.blocks.GetSrcBlockIds())*bs, len(c.blocks.GetDstBlockIds())*bs)
		// A round copies whole blocks that were written since the last
		// one: the block holding the first unchecked position went again,
		// its checked slots too, and is checked again from its start.
		from := c.checked - c.checked%bs
		if to <= c.checked {
			continue
		}
		ranges = append(ranges, warmRange{c: c, from: from, to: to})
		for t := from; t < to; {
			i, first := t/bs, t%bs
			n := min(bs-first, to-t)
			src = append(src, &v1.BlockSlots{Block: c.blocks.SrcBlockIds[i], FirstSlot: int32(first), NumSlots: int32(n)})
			dst = append(dst, &v1.BlockSlots{Block: c.blocks.DstBlockIds[i], FirstSlot: int32(first), NumSlots: int32(n)})
			owner = append(owner, len(ranges)-1)
			t += n
		}
	}
	m.warm.mu.Unlock()
	if len(src) == 0 {
		return nil, nil
	}
	type answer struct {
		r   *v1.HashBlocksResponse
		err error
	}
	ask := func(scheme string) (answer, answer) {
		sc, dc := make(chan answer, 1), make(chan answer, 1)
		go func() {
			r, err := sa.RPC.HashBlocks(ctx, &v1.HashBlocksRequest{MigrationId: session, Blocks: src, Scheme: scheme})
			sc <- answer{r, err}
		}()
		go func() {
			r, err := da.RPC.HashBlocks(ctx, &v1.HashBlocksRequest{MigrationId: session, Blocks: dst, Scheme: scheme})
			dc <- answer{r, err}
		}()
		return <-sc, <-dc
	}
	// GPU KV is hashed in place on the GPU (kvsum); where either agent
	// answers in another scheme, both hash in xxhash64, which every agent
	// serves (the migration's check does the same).
	scheme := ""
	if transfer.OnGPU(dl) {
		scheme = kvsum.Scheme
	}
	a, b := ask(scheme)
	if scheme != "" && a.err == nil && b.err == nil && (a.r.GetScheme() != scheme || b.r.GetScheme() != scheme) {
		a, b = ask("")
	}
	switch {
	case a.err != nil:
		return nil, fmt.Errorf("hash the source's blocks: %w", a.err)
	case b.err != nil:
		return nil, fmt.Errorf("hash the standby's blocks: %w", b.err)
	case len(a.r.GetHashes()) != len(src) || len(b.r.GetHashes()) != len(dst):
		return nil, fmt.Errorf("%d and %d hashes for %d blocks", len(a.r.GetHashes()), len(b.r.GetHashes()), len(src))
	}
	bad := make([]bool, len(ranges))
	for i := range src {
		if a.r.GetHashes()[i] != b.r.GetHashes()[i] {
			bad[owner[i]] = true
		}
	}
	var differ []*copyOf
	m.warm.mu.Lock()
	for k, r := range ranges {
		if bad[k] {
			differ = append(differ, r.c)
			continue
		}
		r.c.checked = r.to
	}
	m.warm.mu.Unlock()
	if len(differ) > 0 {
		ids := make([]string, len(differ))
		for i, c := range differ {
			ids[i] = c.id
		}
		m.log.Warn("warm standby: copies differ from what their source holds; dropped (their failover recomputes)",
			zap.Strings("request_ids", ids), zap.Int("checked_blocks", len(src)))
	}
	return differ, nil
}

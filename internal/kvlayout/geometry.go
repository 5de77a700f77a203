// Package kvlayout describes the shape of a paged KV cache and where each
// byte of it lives in memory. It is shared by the engine (vhi sim), which
// writes and reads KV through it, and by the data plane, which plans copies
// with it. Everything here is a pure function of the geometry.
package kvlayout

import (
	"fmt"
	"sort"
	"strings"
)

// Geometry is the model-side shape of the KV cache of a whole model.
type Geometry struct {
	Layers     int    `json:"num_layers"`
	KVHeads    int    `json:"num_kv_heads"`
	HeadDim    int    `json:"head_dim"`
	DTypeBytes int    `json:"dtype_bytes"`
	DType      string `json:"dtype"`
	BlockSize  int    `json:"block_size"`
	NumBlocks  int    `json:"num_blocks"`
}

// Profile is a named model geometry before scaling.
type Profile struct {
	Name       string
	Layers     int
	KVHeads    int
	HeadDim    int
	DTypeBytes int
	DType      string
}

var profiles = map[string]Profile{
	// Qwen3-8B: 36 layers, 8 KV heads (GQA), head dim 128, bf16.
	"qwen3-8b": {Name: "qwen3-8b", Layers: 36, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, DType: "bfloat16"},
	// Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, bf16.
	"llama3-8b": {Name: "llama3-8b", Layers: 32, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, DType: "bfloat16"},
	// Qwen3-32B: 64 layers, 8 KV heads, head dim 128, bf16.
	"qwen3-32b": {Name: "qwen3-32b", Layers: 64, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, DType: "bfloat16"},
	// A toy shape for unit tests: 4 layers, 4 KV heads, head dim 8, bf16.
	"tiny": {Name: "tiny", Layers: 4, KVHeads: 4, HeadDim: 8, DTypeBytes: 2, DType: "bfloat16"},
}

// ProfileNames lists the known profiles, sorted.
func ProfileNames() []string {
	names := make([]string, 0, len(profiles))
	for n := range profiles {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// LookupProfile returns the named profile.
func LookupProfile(name string) (Profile, error) {
	p, ok := profiles[strings.ToLower(name)]
	if !ok {
		return Profile{}, fmt.Errorf("unknown model profile %q (known: %s)", name, strings.Join(ProfileNames(), ", "))
	}
	return p, nil
}

// Scaled returns the geometry of p with its head dimension divided by
// headDimDivisor. Layers and heads are kept, so TP head slicing and PP layer
// ranges behave exactly as on the full model; only the bytes per head shrink.
func (p Profile) Scaled(headDimDivisor, blockSize, numBlocks int) (Geometry, error) {
	if headDimDivisor < 1 || p.HeadDim%headDimDivisor != 0 {
		return Geometry{}, fmt.Errorf("kv scale %d must be ≥ 1 and divide head dim %d", headDimDivisor, p.HeadDim)
	}
	g := Geometry{
		Layers: p.Layers, KVHeads: p.KVHeads, HeadDim: p.HeadDim / headDimDivisor,
		DTypeBytes: p.DTypeBytes, DType: p.DType, BlockSize: blockSize, NumBlocks: numBlocks,
	}
	return g, g.Validate()
}

// Validate checks that the geometry is usable.
func (g Geometry) Validate() error {
	switch {
	case g.Layers < 1, g.KVHeads < 1, g.HeadDim < 1, g.DTypeBytes < 1:
		return fmt.Errorf("invalid KV geometry %+v: every dimension must be ≥ 1", g)
	case g.BlockSize < 1 || g.BlockSize > 1024:
		return fmt.Errorf("block size %d out of range 1..1024", g.BlockSize)
	case g.NumBlocks < 2:
		return fmt.Errorf("num blocks %d: need at least 2 (block 0 is the reserved null block)", g.NumBlocks)
	}
	return nil
}

// HeadSlotBytes is the size of one head's K (or V) vector for one token.
func (g Geometry) HeadSlotBytes() int { return g.HeadDim * g.DTypeBytes }

// TokenBytes is the KV size of one token across the whole model (K and V,
// every layer and head).
func (g Geometry) TokenBytes() int { return 2 * g.Layers * g.KVHeads * g.HeadSlotBytes() }

// BlockBytes is the KV size of one block across the whole model.
func (g Geometry) BlockBytes() int { return g.TokenBytes() * g.BlockSize }

// Shard is one rank × stage of a TP×PP deployment.
type Shard struct {
	TPRank  int `json:"tp_rank"`
	PPStage int `json:"pp_stage"`
	TPSize  int `json:"tp_size"`
	PPSize  int `json:"pp_size"`
}

// Parallel is a TP×PP shape.
type Parallel struct {
	TP int `json:"tp"`
	PP int `json:"pp"`
}

// Validate checks that g can be sharded as p.
func (p Parallel) Validate(g Geometry) error {
	if p.TP < 1 || p.PP < 1 {
		return fmt.Errorf("tp %d and pp %d must be ≥ 1", p.TP, p.PP)
	}
	if g.KVHeads%p.TP != 0 {
		return fmt.Errorf("tp %d must divide num KV heads %d", p.TP, g.KVHeads)
	}
	if p.PP > g.Layers {
		return fmt.Errorf("pp %d exceeds num layers %d", p.PP, g.Layers)
	}
	return nil
}

// Shards lists every rank × stage, stage-major.
func (p Parallel) Shards() []Shard {
	out := make([]Shard, 0, p.TP*p.PP)
	for s := 0; s < p.PP; s++ {
		for r := 0; r < p.TP; r++ {
			out = append(out, Shard{TPRank: r, PPStage: s, TPSize: p.TP, PPSize: p.PP})
		}
	}
	return out
}

// LayerRange returns the [first, end) global layers held by a PP stage, split
// as evenly as vLLM does (earlier stages take the remainder).
func LayerRange(layers, ppSize, stage int) (int, int) {
	base, rem := layers/ppSize, layers%ppSize
	first := stage*base + min(stage, rem)
	n := base
	if stage < rem {
		n++
	}
	return first, first + n
}

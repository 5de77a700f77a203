// Package kvlayout describes the shape of a paged KV cache and where each
// byte of it lives in memory. It is shared by the engine (vhi sim), which
// writes and reads KV through it, and by the data plane, which plans copies
// with it. Everything here is a pure function of the geometry.
package kvlayout

import (
	"fmt"
	"sort"
	"strings"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Geometry is the model-side shape of the KV cache of a whole model: the
// layout hook's type (api/hooks), named here where everything computes
// with it.
type Geometry = hooks.Geometry

// Parallel is a TP×PP shape (api/hooks).
type Parallel = hooks.Parallel

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

// Shard is one rank × stage of a TP×PP deployment.
type Shard struct {
	TPRank  int `json:"tp_rank"`
	PPStage int `json:"pp_stage"`
	TPSize  int `json:"tp_size"`
	PPSize  int `json:"pp_size"`
}

// Shards lists every rank × stage, stage-major.
func Shards(p Parallel) []Shard {
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

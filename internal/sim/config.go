package sim

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// StepModel is how long one engine step takes, modelled on Qwen3-8B in bf16
// on one H200: a fixed launch/sampling cost, a cost per scheduled sequence,
// a cost per token of context attended to, and a cost per prefilled token.
// With the defaults a decode step of 256 sequences at ~800 tokens of context
// takes ~24 ms, and ~28 ms at ~1,300 tokens.
type StepModel struct {
	Fixed           time.Duration
	PerSeq          time.Duration
	PerContextToken time.Duration
	PerPrefillToken time.Duration
}

// DefaultStepModel is documented in docs/sim.md.
func DefaultStepModel() StepModel {
	return StepModel{
		Fixed:           8 * time.Millisecond,
		PerSeq:          40 * time.Microsecond,
		PerContextToken: 30 * time.Nanosecond,
		PerPrefillToken: 25 * time.Microsecond,
	}
}

// Duration is the modelled time of a step.
func (m StepModel) Duration(seqs, contextTokens, prefillTokens int) time.Duration {
	return m.Fixed + time.Duration(seqs)*m.PerSeq +
		time.Duration(contextTokens)*m.PerContextToken +
		time.Duration(prefillTokens)*m.PerPrefillToken
}

// Config configures one simulated engine.
type Config struct {
	Model            string   // the model "path", as vLLM's positional model argument
	ServedModelNames []string // names clients use; defaults to Model
	Profile          string   // KV geometry profile, e.g. qwen3-8b
	KVScale          int      // head-dim divisor applied to the profile
	// KVLayout orders a block's heads and slots in each layer's K and V:
	// "HND" (head-major, a head's slots side by side: the default) or
	// "NHD" (slot-major, a slot's heads side by side: vLLM's own default
	// layout, where a few slots of a block are one run per layer and K/V).
	KVLayout            string
	TP, PP              int
	BlockSize           int
	NumBlocks           int
	MaxNumSeqs          int
	MaxNumBatchedTokens int
	MaxModelLen         int
	Seed                int64
	// EnablePrefixCaching shares the full blocks of a common prompt
	// prefix between requests, as vLLM's automatic prefix caching does
	// (prefixcache.go).
	EnablePrefixCaching bool
	Step                StepModel
	ShmDir              string // where the KV files live
	ShmPrefix           string // KV file name prefix; defaults to vhi-sim-<pid>
	// Device is where the KV lives: "cpu" (shared-memory files, the
	// default), "cuda[:N]" (GPU N's memory, exported as CUDA IPC handles),
	// or one GPU per rank, in vLLM's rank order (PP stage major, TP rank
	// minor): "cuda:0,cuda:1" for TP2 across two GPUs.
	Device string
	// SleepMode is vLLM's --enable-sleep-mode: without it /sleep is
	// refused. SleepTime is how long /sleep takes (level 1 copies the
	// weights to host memory), WakeUpTime how long /wake_up takes, and
	// WeightsLoadTime how long reloading discarded weights takes (after a
	// level-2 sleep).
	// Failpoint makes the sim fail at a chosen point (failpoint.go;
	// tests only).
	Failpoint       string
	SleepMode       bool
	SleepTime       time.Duration
	WakeUpTime      time.Duration
	WeightsLoadTime time.Duration
	// DataParallelSize is the DP size (DP attention, EP MoE): each rank
	// brings MaxNumSeqs seats and MaxNumBatchedTokens of budget, and the
	// ranks step together over their shares. ElasticEP (vLLM's
	// --enable-elastic-ep) makes /scale_elastic_ep change it, in
	// ElasticMode: the seed's three reconfigurations (elastic.go).
	DataParallelSize int
	ElasticEP        bool
	ElasticMode      string
	// The costs of a reconfiguration: starting the joining workers,
	// preparing communication and moving weights (ElasticPrepareTime);
	// warm-up and CUDA-graph capture (ElasticGraphTime); activating the
	// target topology (ElasticActivateTime). ElasticDrain is vLLM's
	// VLLM_ELASTIC_EP_DRAIN_REQUESTS: in-flight requests finish before the
	// commit instead of pausing through it.
	ElasticPrepareTime  time.Duration
	ElasticGraphTime    time.Duration
	ElasticActivateTime time.Duration
	ElasticDrain        bool
	// EOSOneIn: when a request does not ignore EOS, each sampled token is
	// EOS with probability 1/EOSOneIn. 0 disables EOS.
	EOSOneIn int
	// DefaultPauseLease bounds how long a hook pause or allocation lasts
	// when the caller names no lease.
	DefaultPauseLease time.Duration
	// FinishedRetention keeps finished requests attachable for this long.
	FinishedRetention time.Duration
	// HookToken is the agent credential that the engine hooks and vLLM's
	// control routes (sleep, wake_up, pause, resume, scale_elastic_ep)
	// require as a bearer token. Empty: they are open to anyone who
	// reaches the port (vLLM's OpenAI routes always are, as in vLLM
	// without --api-key).
	HookToken string
}

// DefaultConfig returns the defaults `vhi sim` documents: three of these
// and their agents fit side by side on a 24 GiB, 2-core machine.
func DefaultConfig() Config {
	return Config{
		Model:               "Qwen/Qwen3-8B",
		Profile:             "qwen3-8b",
		KVScale:             32,
		KVLayout:            "HND",
		TP:                  1,
		PP:                  1,
		BlockSize:           16,
		NumBlocks:           32768,
		MaxNumSeqs:          256,
		MaxNumBatchedTokens: 8192,
		MaxModelLen:         8192,
		Seed:                0,
		Step:                DefaultStepModel(),
		ShmDir:              "/dev/shm",
		SleepTime:           500 * time.Millisecond,
		WakeUpTime:          2 * time.Second,
		WeightsLoadTime:     5 * time.Second,
		DataParallelSize:    1,
		ElasticMode:         ElasticAsync,
		ElasticPrepareTime:  2 * time.Second,
		ElasticGraphTime:    3 * time.Second,
		ElasticActivateTime: 40 * time.Millisecond,
		EOSOneIn:            512,
		DefaultPauseLease:   10 * time.Second,
		FinishedRetention:   60 * time.Second,
	}
}

// geometry validates c and derives the KV geometry and parallel shape.
func (c *Config) geometry() (kvlayout.Geometry, kvlayout.Parallel, error) {
	prof, err := kvlayout.LookupProfile(c.Profile)
	if err != nil {
		return kvlayout.Geometry{}, kvlayout.Parallel{}, err
	}
	geo, err := prof.Scaled(c.KVScale, c.BlockSize, c.NumBlocks)
	if err != nil {
		return geo, kvlayout.Parallel{}, err
	}
	par := kvlayout.Parallel{TP: c.TP, PP: c.PP}
	if err := par.Validate(geo); err != nil {
		return geo, par, err
	}
	switch c.KVLayout {
	case "", "HND":
		c.KVLayout = "HND"
	case "NHD":
		// The hash reads a slot-major block head by head, slot by slot: in
		// 8-byte words, so that it equals the head-major one.
		if geo.HeadSlotBytes()%8 != 0 {
			return geo, par, fmt.Errorf("kv-layout NHD needs head_dim × dtype bytes to be a multiple of 8 (it is %d; lower --kv-scale)", geo.HeadSlotBytes())
		}
	default:
		return geo, par, fmt.Errorf("kv-layout %q: want HND or NHD", c.KVLayout)
	}
	switch {
	case c.MaxNumSeqs < 1:
		return geo, par, fmt.Errorf("max-num-seqs %d must be ≥ 1", c.MaxNumSeqs)
	case c.MaxModelLen < 2:
		return geo, par, fmt.Errorf("max-model-len %d must be ≥ 2", c.MaxModelLen)
	case c.MaxNumBatchedTokens < c.MaxNumSeqs:
		return geo, par, fmt.Errorf("max-num-batched-tokens %d must be ≥ max-num-seqs %d", c.MaxNumBatchedTokens, c.MaxNumSeqs)
	case (c.MaxModelLen+c.BlockSize-1)/c.BlockSize > c.NumBlocks-1:
		return geo, par, fmt.Errorf("num-blocks %d cannot hold one sequence of max-model-len %d", c.NumBlocks, c.MaxModelLen)
	}
	if c.Model == "" {
		return geo, par, fmt.Errorf("model name must not be empty")
	}
	if len(c.ServedModelNames) == 0 {
		c.ServedModelNames = []string{c.Model}
	}
	if gpu, devs, err := c.devices(); err != nil {
		return geo, par, err
	} else if gpu && len(devs) != 1 && len(devs) != par.TP*par.PP {
		return geo, par, fmt.Errorf("device %q lists %d GPUs for %d ranks (TP %d × PP %d): give one GPU, or one per rank", c.Device, len(devs), par.TP*par.PP, par.TP, par.PP)
	}
	switch c.ElasticMode {
	case ElasticBlocking, ElasticAsync, ElasticAsyncGraphReuse:
	default:
		return geo, par, fmt.Errorf("elastic-mode %q: want %s, %s or %s", c.ElasticMode, ElasticBlocking, ElasticAsync, ElasticAsyncGraphReuse)
	}
	if c.DataParallelSize < 1 {
		return geo, par, fmt.Errorf("data-parallel-size %d must be ≥ 1", c.DataParallelSize)
	}
	if gpu, _, _ := c.devices(); gpu && (c.ElasticEP || c.DataParallelSize > 1) {
		return geo, par, fmt.Errorf("data parallelism and elastic EP are modelled with the KV on the CPU only (--device cpu)")
	}
	if c.ShmPrefix == "" {
		c.ShmPrefix = fmt.Sprintf("vhi-sim-%d", os.Getpid())
	}
	if c.DefaultPauseLease <= 0 {
		c.DefaultPauseLease = 10 * time.Second
	}
	return geo, par, nil
}

// devices parses Device: whether the KV is on GPUs, and on which (one
// ordinal for every rank, or one per rank).
func (c Config) devices() (gpu bool, ordinals []int, err error) {
	d := strings.TrimSpace(c.Device)
	if d == "" || d == "cpu" {
		return false, nil, nil
	}
	for _, one := range strings.Split(d, ",") {
		n, err := cudaOrdinal(strings.TrimSpace(one))
		if err != nil {
			return false, nil, fmt.Errorf("device %q: %w", d, err)
		}
		ordinals = append(ordinals, n)
	}
	return true, ordinals, nil
}

// cudaOrdinal parses "cuda" (GPU 0) or "cuda:N".
func cudaOrdinal(d string) (int, error) {
	switch {
	case d == "cuda":
		return 0, nil
	case strings.HasPrefix(d, "cuda:"):
		n, err := strconv.Atoi(d[len("cuda:"):])
		if err == nil && n >= 0 {
			return n, nil
		}
	}
	return 0, fmt.Errorf("%q: want cpu, cuda, cuda:N, or a list cuda:N,cuda:M,… (one GPU per rank)", d)
}

package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

func newSimCommand(g *globalFlags) *cobra.Command {
	cfg := sim.DefaultConfig()
	var (
		host      string
		port      int
		served    []string
		tokenFile string
		startup   time.Duration
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Run a vLLM stand-in with real paged KV memory (the test oracle)",
		Long: `vhi sim serves vLLM's OpenAI-compatible HTTP API from a continuous-batching
engine whose KV cache is real bytes in shared memory (one file per TP rank × PP
stage). Each next token is computed from KV bytes read back from that memory, so
a request gives the same tokens on any instance whose KV is intact, and a
different continuation as soon as one byte is lost or altered.

The KV geometry comes from a model profile (` + strings.Join(kvlayout.ProfileNames(), ", ") + `) with
the head dimension divided by --kv-scale so a CPU run fits in a few GiB: the
default qwen3-8b at scale 32 keeps 36 layers and 8 KV heads and stores 4.5 KiB
per token (72 KiB per 16-token block), head-major (--kv-layout HND; NHD is
vLLM's own default: a slot's heads side by side). The step time follows a model of an 8B
model on one H200 (see --step-* flags): ~25-30 ms per decode step at 256
sequences.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger()
			if err != nil {
				return err
			}
			defer func() { _ = log.Sync() }()
			cfg.ServedModelNames = served
			tok, from, err := engineToken(tokenFile)
			if err != nil {
				return fmt.Errorf("sim: engine token: %w", err)
			}
			cfg.HookToken = tok
			if tok == "" {
				log.Warn("the engine hooks and control routes are open to anyone who reaches this port: give the agent token with --engine-token-file or VLLM_HI_ENGINE_TOKEN_FILE")
			} else {
				log.Info("engine hooks need the agent token", zap.String("token_file", from))
			}
			if startup > 0 {
				// vLLM loads its weights and captures its graphs before
				// it listens: a client sees the port refuse until then.
				log.Info("modelled start-up before listening", zap.Duration("startup_time", startup))
				select {
				case <-cmd.Context().Done():
					return nil
				case <-time.After(startup):
				}
			}
			return runSim(cmd.Context(), cfg, net.JoinHostPort(host, fmt.Sprint(port)), log)
		},
	}
	f := cmd.Flags()
	f.StringVar(&host, "host", "127.0.0.1", "address to listen on")
	f.IntVar(&port, "port", 8000, "port to listen on")
	f.StringVar(&cfg.Model, "model", cfg.Model, "model name (vLLM's positional model argument), reported as root in /v1/models")
	f.StringSliceVar(&served, "served-model-name", nil, "name(s) clients use in the model field (default: --model)")
	f.StringVar(&cfg.Profile, "profile", cfg.Profile, "KV geometry profile: "+strings.Join(kvlayout.ProfileNames(), ", "))
	f.IntVar(&cfg.KVScale, "kv-scale", cfg.KVScale, "divide the profile's head dim by this to shrink KV bytes (1 = full size)")
	if l := os.Getenv("VLLM_KV_CACHE_LAYOUT"); l != "" {
		cfg.KVLayout = l // vLLM's own setting of the same thing
	}
	f.StringVar(&cfg.KVLayout, "kv-layout", cfg.KVLayout, "each layer's KV shape: HND (a block's heads, then slots) or NHD (slots, then heads: vLLM's default); default from VLLM_KV_CACHE_LAYOUT")
	f.StringVar(&cfg.Failpoint, "failpoint", "", "fail at a chosen point of a migration (tests): stop-on-install")
	_ = f.MarkHidden("failpoint")
	f.IntVar(&cfg.TP, "tensor-parallel-size", cfg.TP, "TP size: KV heads are split across this many ranks (one KV region each)")
	f.IntVar(&cfg.PP, "pipeline-parallel-size", cfg.PP, "PP size: layers are split across this many stages (one KV region each)")
	// The contract's short names (vLLM spells them -tp and -pp): the same settings.
	f.IntVar(&cfg.TP, "tp", cfg.TP, "the same as --tensor-parallel-size")
	f.IntVar(&cfg.PP, "pp", cfg.PP, "the same as --pipeline-parallel-size")
	f.IntVar(&cfg.BlockSize, "block-size", cfg.BlockSize, "tokens per KV block")
	f.IntVar(&cfg.NumBlocks, "num-gpu-blocks", cfg.NumBlocks, "KV blocks per region, including the reserved null block 0")
	f.IntVar(&cfg.MaxNumSeqs, "max-num-seqs", cfg.MaxNumSeqs, "most sequences in one step")
	f.IntVar(&cfg.MaxNumBatchedTokens, "max-num-batched-tokens", cfg.MaxNumBatchedTokens, "token budget of one step (chunked prefill)")
	f.IntVar(&cfg.MaxModelLen, "max-model-len", cfg.MaxModelLen, "longest sequence (prompt + output)")
	f.Int64Var(&cfg.Seed, "seed", cfg.Seed, "engine seed: the seed of requests that give none is derived from it and the prompt")
	f.BoolVar(&cfg.EnablePrefixCaching, "enable-prefix-caching", cfg.EnablePrefixCaching, "share the full blocks of a common prompt prefix between requests, as vLLM's automatic prefix caching (engines a migration moves between must agree on it)")
	f.DurationVar(&cfg.Step.Fixed, "step-fixed", cfg.Step.Fixed, "modelled fixed cost of every step")
	f.DurationVar(&cfg.Step.PerSeq, "step-per-seq", cfg.Step.PerSeq, "modelled cost per scheduled sequence")
	f.DurationVar(&cfg.Step.PerContextToken, "step-per-context-token", cfg.Step.PerContextToken, "modelled cost per token of context attended to")
	f.DurationVar(&cfg.Step.PerPrefillToken, "step-per-prefill-token", cfg.Step.PerPrefillToken, "modelled cost per prefilled token")
	f.StringVar(&cfg.ShmDir, "shm-dir", cfg.ShmDir, "directory of the shared-memory KV files (a tmpfs)")
	f.StringVar(&cfg.Device, "device", "cpu", "where the KV lives: cpu (shared-memory files), cuda[:N] (GPU N, exported through CUDA IPC), or one GPU per rank in vLLM's rank order (cuda:0,cuda:1 for TP2 over two GPUs)")
	f.DurationVar(&startup, "startup-time", 0, "modelled start-up: the engine listens only after this long (vLLM loads weights and captures graphs first)")
	f.BoolVar(&cfg.SleepMode, "enable-sleep-mode", false, "serve /sleep and /wake_up (vLLM's --enable-sleep-mode)")
	f.DurationVar(&cfg.SleepTime, "sleep-time", cfg.SleepTime, "how long /sleep takes")
	f.DurationVar(&cfg.WakeUpTime, "wake-up-time", cfg.WakeUpTime, "how long /wake_up takes")
	f.DurationVar(&cfg.WeightsLoadTime, "weights-load-time", cfg.WeightsLoadTime, "how long /collective_rpc reload_weights takes (after a level-2 sleep)")
	f.IntVar(&cfg.DataParallelSize, "data-parallel-size", cfg.DataParallelSize, "DP size (DP attention, EP MoE): each rank brings --max-num-seqs seats")
	f.BoolVar(&cfg.ElasticEP, "enable-elastic-ep", false, "let /scale_elastic_ep change the DP size (vLLM's --enable-elastic-ep)")
	f.StringVar(&cfg.ElasticMode, "elastic-mode", cfg.ElasticMode, "reconfiguration: blocking, async (prepare in the background) or async_graph_reuse (graphs kept too)")
	f.DurationVar(&cfg.ElasticPrepareTime, "elastic-prepare-time", cfg.ElasticPrepareTime, "starting joining workers, communication and weights")
	f.DurationVar(&cfg.ElasticGraphTime, "elastic-graph-time", cfg.ElasticGraphTime, "warm-up and CUDA-graph capture")
	f.DurationVar(&cfg.ElasticActivateTime, "elastic-activate-time", cfg.ElasticActivateTime, "activating the target topology")
	f.BoolVar(&cfg.ElasticDrain, "elastic-drain", false, "in-flight requests finish before the commit (vLLM's VLLM_ELASTIC_EP_DRAIN_REQUESTS) instead of pausing through it")
	f.IntVar(&cfg.EOSOneIn, "eos-one-in", cfg.EOSOneIn, "unless ignore_eos, each token is EOS with probability 1/N (0: never)")
	f.DurationVar(&cfg.DefaultPauseLease, "hook-lease", cfg.DefaultPauseLease, "default lease of hook pauses and block reservations")
	f.StringVar(&tokenFile, "engine-token-file", "", "the agent token the hooks and control routes require [VLLM_HI_ENGINE_TOKEN_FILE] (default: the local Host's agent-token, if any)")
	return cmd
}

// runSim serves one engine until ctx ends, then shuts down in reverse order
// of start: HTTP server (draining), engine loop, KV memory.
func runSim(ctx context.Context, cfg sim.Config, addr string, log *zap.Logger) error {
	eng, err := sim.NewEngine(cfg, log.Named("sim"))
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	defer eng.Close()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("sim: listen: %w", err)
	}
	engCtx, stopEngine := context.WithCancel(context.Background())
	engDone := make(chan struct{})
	go func() { defer close(engDone); eng.Run(engCtx) }()
	defer func() { stopEngine(); <-engDone }()

	srv := newHTTPServer(sim.NewServer(eng, log).Handler())
	c := eng.Config()
	g := eng.Geometry()
	log.Info("vhi sim serving",
		zap.String("addr", ln.Addr().String()), zap.Strings("served_model_names", c.ServedModelNames),
		zap.String("profile", c.Profile), zap.Int("kv_scale", c.KVScale), zap.Int("tp", c.TP), zap.Int("pp", c.PP),
		zap.Int("num_blocks", g.NumBlocks), zap.Int("kv_bytes_per_token", g.TokenBytes()),
		zap.String("kv_bytes_total", fmt.Sprintf("%.2f GiB", float64(g.BlockBytes())*float64(g.NumBlocks)/(1<<30))))
	return serveUntil(ctx, srv, ln, log)
}

// newHTTPServer sets ReadHeaderTimeout but no WriteTimeout: responses may be
// long-lived SSE streams.
func newHTTPServer(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: 120 * time.Second}
}

// serveUntil serves until ctx ends, then drains for up to 10 s.
func serveUntil(ctx context.Context, srv *http.Server, ln net.Listener, log *zap.Logger) error {
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("serve: %w", err)
	case <-ctx.Done():
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("shutdown: %w", err)
	}
	_ = srv.Close()
	return nil
}

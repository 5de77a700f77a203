package cli

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/agent"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
)

// envDefault returns the environment variable's value, or def.
func envDefault(key, def string) string {
	if v, ok := os.LookupEnv(key); ok && v != "" {
		return v
	}
	return def
}

func newAgentCommand(g *globalFlags) *cobra.Command {
	var (
		cfg         agent.Config
		tokenFile   string
		legacyToken string
		dataPort    string
		paceRound0  string
	)
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the sidecar beside one engine: register it with the Host and drive its hooks",
		Long: `vhi agent registers its engine with the Host, heartbeats, re-registers when the Host
restarts, and deregisters on shutdown. An engine that serves the vllm-hi hooks (vhi sim,
vLLM with the vllm-hi plugin) is migratable; any other OpenAI-compatible server
registers as routing-only.

Flags default to these environment variables: VLLM_HI_TYPE, VLLM_HI_HOST,
VLLM_HI_DATA_PORT, VLLM_HI_TRANSFER_BACKEND.

The agent token (--token-file; default: the agent-token a Host on this machine keeps
in its data directory) is presented to the Host, required from the Host on this agent's
gRPC service, and presented to the engine's hooks. Start the engine with
VLLM_HI_ENGINE_TOKEN_FILE naming the same file.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger()
			if err != nil {
				return err
			}
			defer func() { _ = log.Sync() }()
			if cfg.DataPort, err = strconv.Atoi(dataPort); err != nil {
				return fmt.Errorf("--data-port (or VLLM_HI_DATA_PORT) %q is not a port number", dataPort)
			}
			if cfg.PaceRound0, err = strconv.ParseFloat(paceRound0, 64); err != nil || cfg.PaceRound0 < 0 || cfg.PaceRound0 > 100 {
				return usageError{fmt.Errorf("--pace-round0 (or VLLM_HI_PACE_ROUND0) %q: want a share of the engine's step from 0 (off) to 100", paceRound0)}
			}
			if tokenFile == "" {
				tokenFile = legacyToken
			}
			if cfg.AgentToken, err = credentials.Resolve(tokenFile, credentials.AgentTokenFile, "--token-file", true); err != nil {
				return err
			}
			a, err := agent.New(cfg, log.Named("agent"))
			if err != nil {
				return err
			}
			return a.Run(cmd.Context())
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Type, "type", envDefault("VLLM_HI_TYPE", ""), "instance type: A (active) or B (standby) [VLLM_HI_TYPE]")
	f.StringVar(&cfg.HostAddr, "host", envDefault("VLLM_HI_HOST", ""), "the Host's address IP:PORT, or several Hosts sharing a store, comma-separated (it registers with each) [VLLM_HI_HOST]")
	f.StringVar(&cfg.EngineURL, "engine", "http://127.0.0.1:8000", "the engine's base URL")
	f.StringVar(&cfg.EngineCoreSocket, "engine-core-socket", envDefault("VLLM_HI_CORE_SOCKET", ""), "the engine's core channel, a Unix socket (vLLM with the plugin's --vllm-hi-core-socket): pause, resume, the request list, changes, allocations and stats go straight to the engine core [VLLM_HI_CORE_SOCKET]")
	f.StringVar(&dataPort, "data-port", envDefault("VLLM_HI_DATA_PORT", "0"), "KV data-plane TCP port [VLLM_HI_DATA_PORT]")
	f.StringVar(&cfg.TransferBackend, "transfer-backend", envDefault("VLLM_HI_TRANSFER_BACKEND", "auto"), "auto, tcp_shm, cuda_ipc or rdma [VLLM_HI_TRANSFER_BACKEND]")
	f.StringVar(&cfg.ID, "id", "", "vllm_hi_id to register as (default: derived from --type and --engine, stable across restarts)")
	f.StringVar(&cfg.Listen, "listen", "", "address of the agent's own gRPC service (the Host dials it; default: the advertised address, any port)")
	f.StringVar(&cfg.AdvertiseHost, "advertise-host", "", "host the Host reaches this agent at (default: the local address routing to the Host)")
	f.StringVar(&tokenFile, "token-file", envDefault("VLLM_HI_TOKEN_FILE", ""), "file holding the agent token [VLLM_HI_TOKEN_FILE] (default: the local Host's agent-token)")
	f.StringVar(&legacyToken, "admin-token-file", "", "the agent token's file (the first wave's name; use --token-file)")
	_ = f.MarkHidden("admin-token-file")
	tlsFlags(cmd, &cfg.TLS)
	f.IntVar(&cfg.TP, "tensor-parallel-size", 1, "TP size to report for an engine without hooks")
	f.IntVar(&cfg.PP, "pipeline-parallel-size", 1, "PP size to report for an engine without hooks")
	f.DurationVar(&cfg.EngineWait, "engine-wait", 15*time.Minute, "how long to wait for the engine to become healthy")
	f.DurationVar(&cfg.DrainGrace, "drain-grace", 30*time.Second, "on SIGTERM, how long an active instance's agent waits for the Host to drain it (its streams move to the other instances) before it exits; 0: exit at once")
	f.StringVar(&cfg.HealthListen, "health-listen", envDefault("VLLM_HI_HEALTH_LISTEN", ""), "serve GET /healthz on this address (off when empty) [VLLM_HI_HEALTH_LISTEN]")
	f.StringVar(&paceRound0, "pace-round0", envDefault("VLLM_HI_PACE_ROUND0", "0"), "send a migration's round 0 in chunks of about this share of the engine's step time, one per step, so that the copy does not slow its decode and its clients (0: off; 0.25: a quarter of each step) [VLLM_HI_PACE_ROUND0]")
	f.StringVar(&cfg.Failpoint, "failpoint", "", "die at a chosen point of a migration (tests): exit-on-<hook>, e.g. exit-on-export")
	_ = f.MarkHidden("failpoint")
	f.StringVar(&cfg.DrainedFile, "drained-file", "", "on SIGTERM, create this file once that drain is over (an engine container's preStop hook waits for it)")
	return cmd
}

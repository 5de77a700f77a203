package cli

import (
	"fmt"
	"net"
	"os"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
)

func newHostCommand(g *globalFlags) *cobra.Command {
	cfg := host.DefaultConfig()
	var tokenFile, debugAddr string
	cmd := &cobra.Command{
		Use:   "host",
		Short: "Run the Host: registry, OpenAI routing and SSE proxy, REST API, metrics, agents' gRPC",
		Long: `vhi host is the one address clients, operators and agents use. OpenAI traffic
(/v1/chat/completions, /v1/completions, /v1/models) is routed by model to the active
instance serving it; /vllm_hi/* is the REST API; /metrics is Prometheus; agents reach
the gRPC registry on the same address.

With --admin-token-file, /vllm_hi/* mutations and agent registration need the token
(HTTP: "Authorization: Bearer <token>"; agents: --admin-token-file on vhi agent).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger()
			if err != nil {
				return err
			}
			defer func() { _ = log.Sync() }()
			if tokenFile != "" {
				if cfg.AdminToken, err = host.ReadAdminToken(tokenFile); err != nil {
					return err
				}
			}
			if err := migrationEnv(&cfg.Migration); err != nil {
				return err
			}
			if cfg.HeartbeatInterval <= 0 || cfg.MissedHeartbeats < 1 {
				return fmt.Errorf("--heartbeat-interval must be > 0 and --missed-heartbeats ≥ 1")
			}
			if debugAddr != "" {
				if err := serveDebug(debugAddr, log); err != nil {
					return err
				}
			}
			ln, err := net.Listen("tcp", cfg.Listen)
			if err != nil {
				return fmt.Errorf("host: listen: %w", err)
			}
			return host.New(cfg, log).Serve(cmd.Context(), ln)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Listen, "listen", cfg.Listen, "address for HTTP, metrics and the agents' gRPC")
	f.StringVar(&tokenFile, "admin-token-file", "", "file holding the admin token; when set, mutations and agent registration need it")
	f.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", cfg.HeartbeatInterval, "how often agents heartbeat")
	f.IntVar(&cfg.MissedHeartbeats, "missed-heartbeats", cfg.MissedHeartbeats, "missed heartbeats before an instance is unreachable")
	f.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", cfg.ShutdownTimeout, "on SIGTERM, how long open streams may finish")
	f.DurationVar(&cfg.Migration.PauseLease, "migration-pause-lease", cfg.Migration.PauseLease, "a paused source resumes by itself after this long without confirmation")
	f.DurationVar(&cfg.Migration.ReservationLease, "migration-reservation-lease", cfg.Migration.ReservationLease, "a target frees unclaimed reserved blocks after this long")
	f.IntVar(&cfg.Migration.DefaultTN, "migration-tn", cfg.Migration.DefaultTN, "default data-plane connections per migration")
	f.BoolVar(&cfg.Migration.AllowFaultInjection, "allow-fault-injection", false, "accept inject_fault in migrate requests (tests only)")
	_ = f.MarkHidden("allow-fault-injection")
	f.StringVar(&debugAddr, "debug-addr", "", "serve Go's pprof profiles on this separate address (e.g. 127.0.0.1:6060)")
	f.DurationVar(&cfg.ClientWriteTimeout, "client-write-timeout", cfg.ClientWriteTimeout, "cut a streaming client whose socket accepts nothing for this long")
	return cmd
}

// migrationEnv reads the seed's tuning variables.
func migrationEnv(c *migrate.Config) error {
	for _, v := range []struct {
		key string
		dst *int
	}{{"VLLM_HI_MAX_INCR_ROUNDS", &c.MaxIncrRounds}, {"VLLM_HI_INCR_STALL_ROUNDS", &c.StallRounds}} {
		if s := os.Getenv(v.key); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 {
				return fmt.Errorf("%s=%q: want an integer ≥ 1", v.key, s)
			}
			*v.dst = n
		}
	}
	if s := os.Getenv("VLLM_HI_REQUEST_FILTER"); s != "" {
		if _, err := migrate.ParseFilter(s); err != nil {
			return fmt.Errorf("VLLM_HI_REQUEST_FILTER: %w", err)
		}
		c.DefaultFilter = s
	}
	return nil
}

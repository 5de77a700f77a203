package cli

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/hostconfig"
	"github.com/vllm-hi/vllm-hi/internal/migrate"
)

func newHostCommand(g *globalFlags) *cobra.Command {
	cfg := host.DefaultConfig()
	var adminFile, agentFile, debugAddr, configFile string
	var check, printSchema bool
	cmd := &cobra.Command{
		Use:   "host",
		Short: "Run the Host: registry, OpenAI routing and SSE proxy, REST API, metrics, agents' gRPC",
		Long: `vhi host is the one address clients, operators and agents use. OpenAI traffic
(/v1/chat/completions, /v1/completions, /v1/models) is routed by model to the active
instance serving it; /vllm_hi/* is the REST API; /metrics is Prometheus; agents reach
the gRPC registry on the same address.

Every plane is authenticated. /vllm_hi/* mutations need the admin token (HTTP
"Authorization: Bearer <token>"); agents register with the agent token, which the Host
also presents to agents and to engines' hooks. Without --admin-token-file and
--agent-token-file the Host creates both in --data-dir on first start (admin-token,
agent-token, mode 0600) and keeps them; agents, engines and the CLI on this machine
find them there. The data directory also keeps roles, lifecycle and migration records
across restarts.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if printSchema {
				b, err := hostconfig.Schema(hostSettings(cmd))
				if err != nil {
					return err
				}
				_, err = fmt.Fprintln(cmd.OutOrStdout(), string(b))
				return err
			}
			// The file first: its host section sets the flags the command
			// line did not, before anything reads them.
			var file hostconfig.File
			var applied, kept []string
			if configFile != "" {
				var err error
				if file, err = hostconfig.Load(configFile); err != nil {
					return usageError{err}
				}
				if applied, kept, err = applyHostSection(cmd, file.Host); err != nil {
					return usageError{fmt.Errorf("%s: %w", configFile, err)}
				}
			}
			if check {
				if err := checkHostConfig(cmd, cfg, configFile, file); err != nil {
					return err
				}
				if len(applied)+len(kept) > 0 {
					fmt.Fprintf(cmd.OutOrStdout(), "from the file: %s\n", strings.Join(applied, " "))
					if len(kept) > 0 {
						fmt.Fprintf(cmd.OutOrStdout(), "the command line's instead of the file's: %s\n", strings.Join(kept, " "))
					}
				}
				return nil
			}
			log, err := g.logger()
			if err != nil {
				return err
			}
			defer func() { _ = log.Sync() }()
			if cfg.AdminToken, cfg.AgentToken, err = hostTokens(cfg.DataDir, adminFile, agentFile, log); err != nil {
				return err
			}
			if err := migrationEnv(&cfg.Migration); err != nil {
				return err
			}
			if configFile != "" {
				cfg.Migration.Launchers = file.Targets
				cfg.Models, cfg.Controller, cfg.Autoscale = file.Models, file.Controller, file.Autoscale
			}
			cfg.Migration.HostAddr = agentFacing(cfg.Listen)
			cfg.Migration.LaunchLogDir = filepath.Join(cfg.DataDir, "launched")
			if cfg.HeartbeatInterval <= 0 || cfg.MissedHeartbeats < 1 {
				return fmt.Errorf("--heartbeat-interval must be > 0 and --missed-heartbeats ≥ 1")
			}
			if debugAddr != "" {
				if err := serveDebug(debugAddr, log); err != nil {
					return err
				}
			}
			h, err := host.NewContext(cmd.Context(), cfg, log.Named("host"))
			if err != nil {
				return err
			}
			ln, err := net.Listen("tcp", cfg.Listen)
			if err != nil {
				return fmt.Errorf("host: listen: %w", err)
			}
			// SIGHUP re-reads --config: the launch targets and the
			// autoscaling policies change without a restart.
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			go reloadOnHUP(cmd.Context(), hup, h, configFile, file.Host, log)
			return h.Serve(cmd.Context(), ln)
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Listen, "listen", cfg.Listen, "address for HTTP, metrics and the agents' gRPC")
	f.BoolVar(&check, "check", false, "check --config and the flags, say what they set, and exit (0: valid, 2: not) without starting")
	f.BoolVar(&printSchema, "config-schema", false, "print the --config file's JSON Schema (docs/host-config.schema.json) and exit")
	f.StringVar(&configFile, "config", "", "YAML configuration: host (any of these flags by name; the command line wins), targets, models, controller, autoscale")
	f.StringVar(&cfg.DataDir, "data-dir", credentials.DefaultDataDir(), "the Host's state: roles, lifecycle, migration records, generated tokens")
	f.StringVar(&cfg.OTLPTracesEndpoint, "otlp-traces-endpoint", envDefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""),
		"export OpenTelemetry spans (relayed requests, migrations and their steps) over OTLP/HTTP to this collector URL, e.g. http://otel:4318 [OTEL_EXPORTER_OTLP_TRACES_ENDPOINT]")
	f.BoolVar(&cfg.AccessLog, "access-log", cfg.AccessLog, "log a line per relayed request (logger access, level info)")
	f.StringVar(&cfg.Store, "store", "bolt", "where the Host's state goes: bolt (the embedded store in --data-dir, one Host) or etcd://HOST:PORT[,HOST:PORT…] (shared: every Host serves, one leads and decides)")
	f.StringVar(&cfg.StorePrefix, "store-prefix", "/vllm-hi/", "the shared store's key prefix (several deployments on one etcd)")
	f.DurationVar(&cfg.StoreLease, "store-lease", 5*time.Second, "how long the shared store stays a dead leading Host's: another Host takes over within this")
	f.StringVar(&cfg.EtcdTLS.CAFile, "etcd-ca-file", "", "CA verifying the etcd members (TLS)")
	f.StringVar(&cfg.EtcdTLS.CertFile, "etcd-cert-file", "", "this Host's client certificate for etcd")
	f.StringVar(&cfg.EtcdTLS.KeyFile, "etcd-key-file", "", "its key")
	f.StringVar(&adminFile, "admin-token-file", "", "file holding the admin token (default: <data-dir>/admin-token, created on first start)")
	f.StringVar(&agentFile, "agent-token-file", "", "file holding the agent token (default: the admin token when --admin-token-file is set, else <data-dir>/agent-token)")
	tlsFlags(cmd, &cfg.TLS)
	f.IntVar(&cfg.MaxConnections, "max-connections", cfg.MaxConnections, "client connections served at once (more wait to be accepted)")
	f.Int64Var(&cfg.MaxRequestBody, "max-request-body", cfg.MaxRequestBody, "bytes of one OpenAI request body")
	f.DurationVar(&cfg.RequestBodyTimeout, "request-body-timeout", cfg.RequestBodyTimeout, "time to receive one request body")
	f.Int64Var(&cfg.BodyMemory, "request-body-memory", cfg.BodyMemory, "bytes of request bodies the Host holds at once (beyond: 503)")
	f.DurationVar(&cfg.UpstreamTimeout, "upstream-timeout", cfg.UpstreamTimeout, "wait this long for an engine's answer to begin (504 after)")
	f.DurationVar(&cfg.StreamIdleTimeout, "stream-idle-timeout", cfg.StreamIdleTimeout, "end a stream whose engine sends nothing for this long")
	f.BoolVar(&cfg.RelayEventLoop, "relay-event-loop", envDefault("VLLM_HI_RELAY_EVENT_LOOP", "false") == "true",
		"relay streams whose client and engine speak plain HTTP/1.1 on epoll loops of the Host's own, one per CPU, instead of a goroutine each: about nginx's CPU per event; such a client's connection closes at its stream's end [VLLM_HI_RELAY_EVENT_LOOP]")
	f.DurationVar(&cfg.InstanceRetention, "instance-retention", cfg.InstanceRetention, "forget an instance whose agent has been gone this long")
	f.DurationVar(&cfg.Migration.RPCTimeout, "migration-rpc-timeout", cfg.Migration.RPCTimeout, "bound on one control call to an agent during a migration")
	f.DurationVar(&cfg.Migration.PauseCallTimeout, "migration-pause-call-timeout", cfg.Migration.PauseCallTimeout,
		"bound on each control call while the source is paused (pause, export, install, commit): a frozen engine or agent rolls back after this")
	f.DurationVar(&cfg.Migration.HeartbeatTimeout, "migration-heartbeat-timeout", cfg.Migration.HeartbeatTimeout,
		"a migration rolls back when its target's engine (through its agent) has not answered the Host's heartbeat for this long")
	f.DurationVar(&cfg.Migration.PauseHeartbeatTimeout, "migration-pause-heartbeat-timeout", cfg.Migration.PauseHeartbeatTimeout,
		"the same while the source is paused (its clients wait)")
	f.BoolVar(&cfg.Migration.PreAttach, "migration-pre-attach", cfg.Migration.PreAttach, "open the moving streams on the target before the pause (the switch then needs no new request per stream)")
	f.StringVar(&cfg.Migration.Verify, "migration-verify", cfg.Migration.Verify, "check before the commit that the target holds the source's KV: sample, full or off")
	f.IntVar(&cfg.Migration.MaxHistory, "migration-history", cfg.Migration.MaxHistory, "migrations kept in the history")
	f.DurationVar(&cfg.Migration.RetireWait, "migration-retire-wait", cfg.Migration.RetireWait, "how long a destroy_source source waits for its remaining requests before releasing its KV")
	f.DurationVar(&cfg.Failover.SnapshotInterval, "failover-snapshot-interval", defaultFailoverSnapshot, "engine-crash failover: how often the Host snapshots the state of the streams it relays, to go on with them on another instance if their engine dies (0: off)")
	f.IntVar(&cfg.Failover.MaxPerModel, "failover-max-per-model", cfg.Failover.MaxPerModel, "engine-crash failover: streams of one model recovered at once")
	f.DurationVar(&cfg.Failover.GatherWindow, "failover-gather-window", cfg.Failover.GatherWindow, "engine-crash failover: how long a dead engine's first broken stream waits for the others, so that they are spread over the survivors by free KV, shortest context first, with one reservation and one install per survivor (0: each placed alone)")
	f.IntVar(&cfg.Failover.RecomputePerStep, "failover-recompute-per-step", cfg.Failover.RecomputePerStep, "engine-crash failover: feed each survivor its share of a dead engine's streams in installs of at most this many tokens of context, each once the last one's prefill is done, so that its own streams see short steps (0: the whole share at once)")
	f.DurationVar(&cfg.Failover.NewStreamSnapshot, "failover-new-stream-snapshot", cfg.Failover.NewStreamSnapshot, "engine-crash failover: how soon a new stream gets its first snapshot, rather than at the next --failover-snapshot-interval (a vLLM stream with tokens and no snapshot cannot go on elsewhere; 0: at the interval)")
	f.IntVar(&cfg.Failover.WarmTokens, "failover-warm-standby-tokens", cfg.Failover.WarmTokens, "engine-crash failover: keep a warm copy of the KV of every stream whose context reached this many tokens on another active instance of its model (a migration's copy rounds each snapshot interval, without the switch), so that its failover installs the copy and computes only the tokens since; the copies hold KV blocks there (0: off)")
	f.DurationVar(&cfg.Failover.WarmInterval, "failover-warm-standby-interval", cfg.Failover.WarmInterval, "engine-crash failover: how often the warm copies get a copy round of what their streams' engines wrote since (a failover computes again about this much of each stream's decode)")
	f.BoolVar(&cfg.Failover.RelayTokenIDs, "failover-token-ids", cfg.Failover.RelayTokenIDs, "engine-crash failover: ask the engines for each stream's token ids (hidden from clients that did not ask), so a survivor takes exactly the client's tokens; false: from the last snapshot")
	f.DurationVar(&cfg.Scale.HoldTimeout, "scale-hold-timeout", cfg.Scale.HoldTimeout, "scaling: how long one request is held through an elastic-EP commit (vLLM's 503) before the 503 goes through")
	f.IntVar(&cfg.Scale.MaxHeld, "scale-max-held", cfg.Scale.MaxHeld, "scaling: requests held through a commit at once")
	f.DurationVar(&cfg.Scale.DrainTimeout, "scale-drain-timeout", cfg.Scale.DrainTimeout, "scaling: vLLM's drain_timeout, where it drains in-flight requests before its commit")
	f.DurationVar(&cfg.Rebalance.Interval, "rebalance-interval", 0, "automatic rebalancing between the active instances of a model: how often it decides (0: off)")
	f.Float64Var(&cfg.Rebalance.KVHigh, "rebalance-kv-high", cfg.Rebalance.KVHigh, "rebalancing: KV use (0..1) at which an instance sheds its longest sequences")
	f.IntVar(&cfg.Rebalance.WaitingHigh, "rebalance-waiting", cfg.Rebalance.WaitingHigh, "rebalancing: more waiting requests than this on an instance shed its longest sequences")
	f.Float64Var(&cfg.Rebalance.Spread, "rebalance-kv-spread", cfg.Rebalance.Spread, "rebalancing: even out two instances whose KV use differs by more than this")
	f.IntVar(&cfg.Rebalance.MaxRequests, "rebalance-max-requests", cfg.Rebalance.MaxRequests, "rebalancing: the longest this many sequences move per decision")
	f.DurationVar(&cfg.Rebalance.Cooldown, "rebalance-cooldown", cfg.Rebalance.Cooldown, "rebalancing: how long an instance rests after a move it took part in")
	f.BoolVar(&cfg.Rebalance.DryRun, "rebalance-dry-run", false, "rebalancing: decide and log (GET /vllm_hi/rebalance), migrate nothing")
	f.DurationVar(&cfg.Migration.DrainTimeout, "drain-timeout", cfg.Migration.DrainTimeout, "how long a drain may take to move its instance's requests and wait for those that cannot move")
	f.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", cfg.HeartbeatInterval, "how often agents heartbeat")
	f.IntVar(&cfg.MissedHeartbeats, "missed-heartbeats", cfg.MissedHeartbeats, "missed heartbeats before an instance is unreachable")
	f.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", cfg.ShutdownTimeout, "on SIGTERM, how long open streams may finish")
	f.DurationVar(&cfg.Migration.PauseLease, "migration-pause-lease", cfg.Migration.PauseLease, "a paused source resumes by itself after this long without confirmation")
	f.StringVar(&cfg.Migration.PauseInFlight, "migration-pause-in-flight", cfg.Migration.PauseInFlight,
		"what the source's pause does with the step in flight of an engine with asynchronous scheduling: drop (pause at once, the target computes that step again) or wait (for its output)")
	f.DurationVar(&cfg.Migration.ReservationLease, "migration-reservation-lease", cfg.Migration.ReservationLease, "a target frees unclaimed reserved blocks after this long; a migration must commit before it ends")
	f.IntVar(&cfg.Migration.DefaultTN, "migration-tn", cfg.Migration.DefaultTN, "default data-plane connections per migration")
	f.BoolVar(&cfg.Migration.AllowFaultInjection, "allow-fault-injection", false, "accept inject_fault in migrate requests (tests only)")
	_ = f.MarkHidden("allow-fault-injection")
	f.StringVar(&debugAddr, "debug-addr", "", "serve Go's pprof profiles on this separate address (e.g. 127.0.0.1:6060)")
	f.DurationVar(&cfg.ClientWriteTimeout, "client-write-timeout", cfg.ClientWriteTimeout, "cut a streaming client whose socket accepts nothing for this long")
	return cmd
}

// agentFacing is the address an agent on this machine registers with for
// a Host listening on listen (an unspecified IP becomes loopback).
func agentFacing(listen string) string {
	h, p, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	if ip := net.ParseIP(h); h == "" || (ip != nil && ip.IsUnspecified()) {
		h = "127.0.0.1"
	}
	return net.JoinHostPort(h, p)
}

// migrationEnv reads the migration tuning variables (VLLM_HI_MAX_INCR_ROUNDS…).
func migrationEnv(c *migrate.Config) error {
	for _, v := range []struct {
		key string
		dst *int
		min int
	}{{"VLLM_HI_MAX_INCR_ROUNDS", &c.MaxIncrRounds, 1}, {"VLLM_HI_INCR_STALL_ROUNDS", &c.StallRounds, 1},
		{"VLLM_HI_CATCH_UP_ROUNDS", &c.CatchUpRounds, 0}} {
		if s := os.Getenv(v.key); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < v.min {
				return fmt.Errorf("%s=%q: want an integer ≥ %d", v.key, s, v.min)
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

// defaultFailoverSnapshot is how often a Host snapshots its streams for
// failover unless told otherwise (the library default is off, for the
// in-process stacks of tests).
const defaultFailoverSnapshot = time.Second

// checkHostConfig is vhi host --check: the configuration file and the
// flags checked as a start would check them, nothing started. What is
// wrong exits 2.
func checkHostConfig(cmd *cobra.Command, cfg host.Config, configFile string, file hostconfig.File) error {
	if cfg.HeartbeatInterval <= 0 || cfg.MissedHeartbeats < 1 {
		return usageError{fmt.Errorf("--heartbeat-interval must be > 0 and --missed-heartbeats ≥ 1")}
	}
	if err := migrationEnv(&cfg.Migration); err != nil {
		return usageError{err}
	}
	if err := cfg.Migration.Check(); err != nil {
		return usageError{err}
	}
	out := cmd.OutOrStdout()
	if configFile == "" {
		fmt.Fprintln(out, "vhi host: the flags are valid (no --config)")
		return nil
	}
	fmt.Fprintf(out, "vhi host: %s is valid: %d host settings, %d launch targets, %d switched models, %d autoscaled models\n",
		configFile, len(file.Host), len(file.Targets), len(file.Models), len(file.Autoscale.Models))
	return nil
}

// reloadOnHUP applies configFile again on each SIGHUP; a file that does
// not check leaves the running configuration as it is.
func reloadOnHUP(ctx context.Context, hup <-chan os.Signal, h *host.Host, configFile string, started map[string]any, log *zap.Logger) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
		}
		if configFile == "" {
			log.Warn("SIGHUP: nothing to reload (no --config)")
			continue
		}
		file, err := hostconfig.Load(configFile)
		if err != nil {
			log.Error("SIGHUP: the configuration file does not check; the running configuration stays", zap.Error(err))
			continue
		}
		h.Reload(file)
		if !reflect.DeepEqual(file.Host, started) {
			log.Warn("SIGHUP: the host section changed; its settings are read at start only: restart the Host to apply them")
		}
	}
}

// Package migrate is the Host's migration orchestrator. A migration runs
// its phases in a fixed order, one file each:
//
//	admission.go  validate the request and both instances (refusals: nothing started)
//	prepare.go    select the requests, reserve their blocks on the target, ready its data plane
//	rounds.go     the full round and incremental rounds while the source decodes
//	verify.go     check the target holds what the source held (before and in the pause)
//	final.go      pause the source, copy the last delta and move the state, commit on the target
//	switch.go     splice every client stream onto the target
//	apply.go      roles, and what the migration type asks of the source
//	undo.go       any failure before the commit: the source resumes, the target frees
//
// Every phase is a named, timed step in the migration's status (steps.go),
// runs under the migration's deadline, and checks it before it starts.
package migrate

import (
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/vllm-hi/vllm-hi/internal/launch"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// Config tunes the orchestrator.
type Config struct {
	// RestoreLater: New does not read the records back; Restore does
	// (a Host that follows a shared store's leader until it leads).
	RestoreLater  bool
	MaxIncrRounds int // VLLM_HI_MAX_INCR_ROUNDS, default 8
	StallRounds   int // VLLM_HI_INCR_STALL_ROUNDS, default 2
	// CatchUpRounds bounds the copy rounds taken after the check before
	// the pause, each followed by a check of what it copied, while that
	// check took longer than CatchUpRatio × the last copy round
	// (VLLM_HI_CATCH_UP_ROUNDS, default 2; 0: none). The source decodes
	// through the check; without them what it wrote meanwhile is the
	// final round's copy and the check inside the pause.
	CatchUpRounds int
	CatchUpRatio  float64       // default 2; 0: catch up whenever CatchUpRounds allows
	DefaultFilter string        // VLLM_HI_REQUEST_FILTER, default all
	DefaultTN     int           // data-plane connections, default 2
	PauseLease    time.Duration // how long the source stays paused without confirmation
	// PauseInFlight is what the source's pause does with the step in
	// flight of an engine with asynchronous scheduling (vLLM's default):
	// "drop" (the default) pauses at once, that step's work for the moving
	// requests dropped and computed again by the target; "wait" waits
	// for it (the pause lands 1–2 decode steps later; the clients' gap is
	// the same either way: their last token from the source comes a step
	// later and the target has one token less to compute).
	PauseInFlight    string
	ReservationLease time.Duration // how long the target holds unclaimed blocks; bounds the migration up to its commit
	SpliceTimeout    time.Duration
	// RPCTimeout bounds one control call to an agent (list, pause,
	// abort…); copy rounds are bounded by the migration's deadline.
	RPCTimeout time.Duration
	// PauseCallTimeout bounds each control call while the source is
	// paused (the pause itself, the export, the target's install, the
	// commit): a frozen or dead engine or agent costs the paused clients
	// this, not the rest of the pause lease. The final copy and the check
	// are bounded by the lease's fence only (their time grows with the
	// bytes). The lease's fence bounds every call too, whichever ends
	// first.
	PauseCallTimeout time.Duration
	// HeartbeatTimeout is how long the target (its engine, through its
	// agent) may not answer the Host's heartbeat before a migration to
	// it rolls back; PauseHeartbeatTimeout the same while the source is
	// paused, its clients waiting (heartbeat.go).
	HeartbeatTimeout      time.Duration
	PauseHeartbeatTimeout time.Duration
	// PreAttach opens the moving streams on the target just before the
	// pause, so the switch reads the target's first tokens from
	// connections already open (engines that cannot: attached after).
	PreAttach bool
	// Verify is the check before the commit (sample, full, off);
	// VerifySamples the random blocks per request it adds in sample mode.
	Verify        string
	VerifySamples int
	// RetireWait bounds how long a destroy_source source waits for the
	// requests left on it before its KV is released.
	RetireWait time.Duration
	// DrainTimeout bounds a drain: moving its requests and waiting for
	// those that cannot move (non-streaming ones) to finish.
	DrainTimeout time.Duration
	// MaxHistory bounds the migrations kept (oldest finished ones go).
	MaxHistory int
	// The Host's agent connections (its agentclient.Pool) are made with
	// these: the agent credential, TLS, and dial options added to every
	// connection's (tests put fault-injecting interceptors there).
	AgentToken       string
	AgentTLS         *tls.Config // dialing agents that serve TLS
	AgentDialOptions []grpc.DialOption
	// Tracer, when set, gets a span per migration and one per step
	// (trace.go).
	Tracer trace.Tracer
	// AllowFaultInjection accepts the inject_fault field (tests only).
	AllowFaultInjection bool
	// Launchers start a migration's target on demand, by served model
	// name (vhi host --config: targets); HostAddr fills their {host}, and
	// their output goes to LaunchLogDir.
	Launchers    map[string]launch.Spec
	HostAddr     string
	LaunchLogDir string
}

// What the source's pause does with an engine's step in flight
// (Config.PauseInFlight).
const (
	PauseInFlightDrop = "drop"
	PauseInFlightWait = "wait"
)

// DefaultConfig returns the defaults.
func DefaultConfig() Config {
	return Config{MaxIncrRounds: 8, StallRounds: 2, CatchUpRounds: 2, CatchUpRatio: 2, DefaultTN: 2, PauseLease: 10 * time.Second, PauseInFlight: PauseInFlightDrop, ReservationLease: 60 * time.Second,
		SpliceTimeout: 5 * time.Second, RPCTimeout: 10 * time.Second, PauseCallTimeout: 2 * time.Second,
		HeartbeatTimeout: 3 * time.Second, PauseHeartbeatTimeout: 500 * time.Millisecond, Verify: hostapi.VerifySample, VerifySamples: 2,
		RetireWait: 10 * time.Minute, DrainTimeout: 10 * time.Minute, MaxHistory: 1000}
}

// margin is how long before a lease ends the Host stops relying on it: a
// call sent at the margin still lands before the lease.
func margin(lease time.Duration) time.Duration {
	return max(500*time.Millisecond, lease/5)
}

// Check says what in the configuration a Host cannot start with.
func (c Config) Check() error {
	switch {
	case c.PauseLease < 2*time.Second:
		return fmt.Errorf("the migration pause lease %v is too short (at least 2s)", c.PauseLease)
	case c.ReservationLease < 2*time.Second:
		return fmt.Errorf("the migration reservation lease %v is too short (at least 2s)", c.ReservationLease)
	case c.RPCTimeout <= 0 || c.SpliceTimeout <= 0 || c.DrainTimeout <= 0 || c.PauseCallTimeout <= 0 ||
		c.HeartbeatTimeout <= 0 || c.PauseHeartbeatTimeout <= 0:
		return fmt.Errorf("migration timeouts must be positive")
	case c.Verify != hostapi.VerifySample && c.Verify != hostapi.VerifyFull && c.Verify != hostapi.VerifyOff:
		return fmt.Errorf("migration verify %q: want sample, full or off", c.Verify)
	case c.CatchUpRounds < 0 || c.CatchUpRatio < 0:
		return fmt.Errorf("migration catch-up rounds and ratio must not be negative")
	case c.PauseInFlight != PauseInFlightDrop && c.PauseInFlight != PauseInFlightWait:
		return fmt.Errorf("migration pause in flight %q: want drop or wait", c.PauseInFlight)
	case c.VerifySamples < 0:
		return fmt.Errorf("migration verify samples must not be negative")
	case c.MaxHistory < 1:
		return fmt.Errorf("the migration history must keep at least one")
	}
	return nil
}

func newID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return "mig-" + hex.EncodeToString(b[:])
}

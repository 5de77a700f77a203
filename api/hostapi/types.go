// Package hostapi is the Host's REST API as its clients see it: the paths,
// the typed requests and answers (the names of docs/operations.md and the
// contract), and Client, the one typed client the CLI, the demo, the
// benchmarks and every test use. The Host encodes these same types.
package hostapi

import "time"

// Paths of the REST API ({id} is an instance or migration id).
const (
	PathHealth          = "/health"
	PathStatus          = "/vllm_hi/status"
	PathInstances       = "/vllm_hi/instances"
	PathInstance        = "/vllm_hi/instances/{id}"
	PathDrain           = "/vllm_hi/instances/{id}/drain"
	PathUndrain         = "/vllm_hi/instances/{id}/undrain"
	PathWake            = "/vllm_hi/instances/{id}/wake"
	PathMigrate         = "/vllm_hi/migrate"
	PathMigrationStatus = "/vllm_hi/migration/{id}/status"
	PathMigrations      = "/vllm_hi/migrations"
	PathDrainStatus     = "/vllm_hi/drains/{id}/status"
	PathDrains          = "/vllm_hi/drains"
	PathRebalance       = "/vllm_hi/rebalance"
	PathScale           = "/vllm_hi/scale"
	PathScaleStatus     = "/vllm_hi/scale/{id}/status"
	PathScales          = "/vllm_hi/scales"
	PathAutoscale       = "/vllm_hi/autoscale"
	// Model switching, the seed's admin routes.
	PathAdminState   = "/admin/state"
	PathAdminSwitch  = "/admin/switch/{model}"
	PathAdminPrewarm = "/admin/prewarm"
)

// Migration types.
const (
	DestroySource    = "destroy_source"
	PreserveSource   = "preserve_source"
	KeepSourceActive = "keep_source_active"
)

// Migration states.
const (
	StateRunning   = "running"
	StateSucceeded = "succeeded"
	StateAborted   = "aborted"
	StateFailed    = "failed"
	// StateRolledBack: a scale whose check failed, put back to its size.
	StateRolledBack = "rolled_back"
)

// Verification modes: what the Host compares between the source's and the
// target's memory before the commit.
const (
	VerifySample = "sample" // every moved request's last tokens, and a few random blocks
	VerifyFull   = "full"   // every moved block
	VerifyOff    = "off"
)

// What happened to a destroy_source migration's source KV.
const (
	SourceKVKept        = "kept"         // preserve_source, keep_source_active
	SourceKVReleasing   = "releasing"    // waiting for the requests left on the source
	SourceKVReleased    = "released"     // the engine gave its KV memory back
	SourceKVNotReleased = "not_released" // the engine could not (source_kv_note says why)
)

// MigrateRequest is the body of POST /vllm_hi/migrate.
type MigrateRequest struct {
	Src              string   `json:"src_vllm_hi_id"`
	Dst              string   `json:"dst_vllm_hi_id"`
	TargetTP         *int     `json:"target_tp,omitempty"`
	TargetPP         *int     `json:"target_pp,omitempty"`
	TargetGPUMemUtil *float64 `json:"target_gpu_memory_utilization,omitempty"`
	Type             string   `json:"migration_type,omitempty"`
	TN               int      `json:"tn,omitempty"`
	RequestFilter    string   `json:"request_filter,omitempty"`
	FinalGranularity string   `json:"final_granularity,omitempty"` // "slot" (default) or "block"
	// PauseInFlight is what the source's pause does with its engine's
	// step in flight: "drop" or "wait" (default: the Host's
	// --migration-pause-in-flight).
	PauseInFlight string `json:"pause_in_flight,omitempty"`
	// InjectFault (tests, --allow-fault-injection): "corrupt", "cut" or
	// "silent_corrupt" in the final round; "crash_before_pause",
	// "crash_after_pause" or "crash_after_commit" (the Host exits there); or
	// "target_full" (the Host treats the target as having no free block:
	// every request moves as state only and recomputes there).
	InjectFault string `json:"inject_fault,omitempty"`
}

// LaunchedTarget is the target a migration launched for itself (a
// migrate request without dst_vllm_hi_id).
type LaunchedTarget struct {
	ID      string `json:"vllm_hi_id"`
	PID     int    `json:"pid,omitempty"`
	LogFile string `json:"log_file"`
}

// MigrateAnswer is POST /vllm_hi/migrate's answer.
type MigrateAnswer struct {
	ID string `json:"migration_id"`
}

// Step is one entry of a migration's step history.
type Step struct {
	Step      string    `json:"step"`
	StartedAt time.Time `json:"started_at"`
	EndedAt   time.Time `json:"ended_at,omitempty"`
	DurationS float64   `json:"duration_s"`
}

// Round is one copy round.
type Round struct {
	Round      int     `json:"round"`
	Kind       string  `json:"kind"` // full, incremental, final
	BlockCount int     `json:"block_count"`
	TokenSlots int     `json:"token_slots"`
	Bytes      int64   `json:"data_size_bytes"`
	DurationS  float64 `json:"duration_s"`
	// SharedBlocks (the full round) are the source blocks that more than
	// one moving request holds (a prompt prefix the engine's prefix cache
	// shares), once per holder after the first. Where the target shares
	// them too, each went once: SharedBytesSaved are the bytes the round
	// did not send for that (0 where the target took a copy per holder).
	SharedBlocks     int   `json:"shared_blocks,omitempty"`
	SharedBytesSaved int64 `json:"shared_bytes_saved,omitempty"`
	// PacedChunks, for a round the source's agent paced by its engine's
	// steps (vhi agent --pace-round0), are the chunks it went in;
	// SourceStepBeforeS the engine's step time before the round and
	// SourceStepSlowestS the slowest a chunk saw it: what the source's
	// clients waited between tokens while the round copied.
	// SourceGapP99S (the full round) is the p99 of the moving streams'
	// inter-token gaps, as this Host relayed them, that ended while the
	// round ran, and SourceGapP99BeforeS the same in the second before it:
	// what round 0 cost the source's clients (0: no gap seen).
	SourceGapP99S       float64 `json:"source_gap_p99_s,omitempty"`
	SourceGapP99BeforeS float64 `json:"source_gap_p99_before_s,omitempty"`
	PacedChunks         int     `json:"paced_chunks,omitempty"`
	SourceStepBeforeS   float64 `json:"source_step_before_s,omitempty"`
	SourceStepSlowestS  float64 `json:"source_step_slowest_s,omitempty"`
}

// Verification is the check that the target holds what the source held.
type Verification struct {
	Mode      string  `json:"mode"`
	Blocks    int     `json:"blocks"` // blocks hashed on each side
	Bytes     int64   `json:"bytes"`  // bytes hashed on each side
	DurationS float64 `json:"duration_s"`
	// PauseDurationS is the part inside the pause (the rest ran while the
	// source decoded).
	PauseDurationS float64 `json:"pause_duration_s"`
}

// MigrationStatus is GET /vllm_hi/migration/{id}/status.
type MigrationStatus struct {
	ID              string  `json:"migration_id"`
	State           string  `json:"state"`
	CurrentStep     string  `json:"current_step"`
	StepHistory     []Step  `json:"step_history"`
	Rounds          []Round `json:"rounds"`
	DowntimeS       float64 `json:"downtime_s"`
	ClientDowntimeS float64 `json:"client_downtime_s"`
	PauseWaitS      float64 `json:"pause_wait_s"`
	// PauseDroppedInFlight counts the moved requests whose step in flight
	// the source's engine dropped at the pause instead of waiting for it
	// (asynchronous scheduling; --migration-pause-in-flight drop): the
	// target computed that position again.
	PauseDroppedInFlight int      `json:"pause_dropped_in_flight,omitempty"`
	NewActiveInstance    string   `json:"new_active_instance"`
	Error                string   `json:"error"`
	Src                  string   `json:"src_vllm_hi_id"`
	Dst                  string   `json:"dst_vllm_hi_id"`
	Type                 string   `json:"migration_type"`
	RequestFilter        string   `json:"request_filter"`
	TN                   int      `json:"tn"`
	Requests             int      `json:"request_count"`
	Migrated             int      `json:"migrated_request_count"`
	Dropped              []string `json:"dropped_request_ids"`
	// Bytes is the KV the rounds sent, each block shared by several
	// moving requests counted as often as it went (once where the target
	// shares it too).
	Bytes int64 `json:"data_size_bytes"`
	// Recomputed are the moved requests whose KV the target could not
	// hold: their state moved and the target recomputes their KV (the
	// rest moved with their KV).
	Recomputed []string `json:"recomputed_request_ids,omitempty"`
	// Staged is how many moving requests the target prepared from a
	// snapshot before the pause (its layout's stages_state; 0 otherwise).
	Staged int `json:"staged_request_count,omitempty"`
	// PreAttached is how many moved streams switched to the target over a
	// connection opened before the pause (the rest attached after it).
	PreAttached  int           `json:"pre_attached_stream_count,omitempty"`
	Verification *Verification `json:"verification,omitempty"`
	// TransferBackend is the data plane the source agent moved the KV
	// with (cuda_ipc, tcp_shm), and TransferBackendReason why it chose it.
	TransferBackend       string `json:"transfer_backend,omitempty"`
	TransferBackendReason string `json:"transfer_backend_reason,omitempty"`
	// Committed: the target took the requests over (ownership flipped).
	Committed bool `json:"committed"`
	// SourceKV says what happened to the source's KV (destroy_source).
	SourceKV     string `json:"source_kv,omitempty"`
	SourceKVNote string `json:"source_kv_note,omitempty"`
	// Launched is the target the Host started for this migration (it
	// named none); the first step, launch_target, is the wait for it.
	Launched  *LaunchedTarget `json:"launched_target,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
	// Deadline is when the migration aborts if it has not committed (the
	// target's block reservation ends soon after).
	Deadline   time.Time `json:"deadline"`
	FinishedAt time.Time `json:"finished_at,omitempty"`
}

// RDMA is an agent's rdma data plane: the UCX it loaded and what UCX
// found on the agent's machine.
type RDMA struct {
	UCXVersion string `json:"ucx_version"`
	// Devices are the RDMA devices (InfiniBand or RoCE); none: UCX moves
	// KV over TCP and shared memory.
	Devices    []string `json:"devices,omitempty"`
	Transports []string `json:"transports,omitempty"`
	// CUDA: the UCX build reaches GPU memory itself.
	CUDA bool `json:"cuda,omitempty"`
}

// GPU is one GPU of an agent's node.
type GPU struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid"`
	Name        string `json:"name"`
	MemoryBytes uint64 `json:"memory_bytes"`
	PCIBusID    string `json:"pci_bus_id"`
}

// Ended reports whether the migration is over.
func (s MigrationStatus) Ended() bool { return s.State != "" && s.State != StateRunning }

// MigrationList is GET /vllm_hi/migrations: newest first.
type MigrationList struct {
	Migrations []MigrationStatus `json:"migrations"`
}

// Instance is one entry of GET /vllm_hi/instances.
type Instance struct {
	ID                 string   `json:"vllm_hi_id"`
	Type               string   `json:"type"`
	Role               string   `json:"role"`
	State              string   `json:"state"`
	Lifecycle          string   `json:"lifecycle"`
	ServedModelName    string   `json:"served_model_name"`
	ServedModelNames   []string `json:"served_model_names"`
	Model              string   `json:"model"`
	EngineURL          string   `json:"engine_url"`
	EngineKind         string   `json:"engine_kind"`
	EngineVersion      string   `json:"engine_version"`
	TP                 int      `json:"tp"`
	PP                 int      `json:"pp"`
	MaxModelLen        int      `json:"max_model_len"`
	Migratable         bool     `json:"migratable"`
	HooksAuthenticated bool     `json:"hooks_authenticated"`
	AgentAddress       string   `json:"agent_address"`
	DataAddress        string   `json:"data_address"`
	TransferBackend    string   `json:"transfer_backend"`
	TLS                bool     `json:"tls"`
	// GPUs are the GPUs of the agent's node as NVML sees them; GPUNote
	// says why there are none ("NVML unavailable: …").
	GPUs    []GPU  `json:"gpus,omitempty"`
	GPUNote string `json:"gpu_note,omitempty"`
	// RDMA is the agent's rdma data plane (UCX); RDMANote says why there
	// is none ("rdma: unavailable: libucp not found …").
	RDMA            *RDMA         `json:"rdma,omitempty"`
	RDMANote        string        `json:"rdma_note,omitempty"`
	Hostname        string        `json:"hostname"`
	RegisteredAt    time.Time     `json:"registered_at"`
	LastHeartbeatAt time.Time     `json:"last_heartbeat_at"`
	Stats           InstanceStats `json:"stats"`
}

// InstanceStats is the load an agent last reported.
type InstanceStats struct {
	Healthy     bool `json:"healthy"`
	NumRunning  int  `json:"num_running"`
	NumWaiting  int  `json:"num_waiting"`
	FreeBlocks  int  `json:"free_blocks"`
	TotalBlocks int  `json:"total_blocks"`
	Sleeping    bool `json:"sleeping"`
}

// InstanceList is GET /vllm_hi/instances.
type InstanceList struct {
	Instances []Instance `json:"instances"`
}

// Status is GET /vllm_hi/status.
type Status struct {
	Status           string         `json:"status"`
	InstanceCount    int            `json:"instance_count"`
	InstancesByState map[string]int `json:"instances_by_state"`
	Models           []string       `json:"models"`
	Version          string         `json:"version"`
	UptimeS          float64        `json:"uptime_s"`
	// Hosts sharing the store (etcd), the leader first; absent with the
	// embedded store.
	Hosts []HostInfo `json:"hosts,omitempty"`
	// SwitchedModels are the switched models' states by alias (model
	// switching; absent without): what the status page shows. The whole
	// state, backends included, is GET /admin/state's.
	SwitchedModels map[string]SwitchedModelSummary `json:"switched_models,omitempty"`
}

// SwitchedModelSummary is a switched model's state in GET /vllm_hi/status.
type SwitchedModelSummary struct {
	State  string `json:"state"`
	Active int    `json:"active"`
	Queued int    `json:"queued"`
	Group  string `json:"group,omitempty"`
}

// HostInfo is one Host of a shared store: every Host serves, the leader
// decides, the others take over in their order. LastSeen is when its
// lease was last renewed.
type HostInfo struct {
	ID       string    `json:"id"`
	Address  string    `json:"address"`
	Leader   bool      `json:"leader"`
	LastSeen time.Time `json:"last_seen"`
}

// ErrorBody is the contract's error shape:
// {"error": {"message", "type", "param", "code"}}.
type ErrorBody struct {
	Error ErrorDetail `json:"error"`
}

// ErrorDetail is the inside of ErrorBody.
type ErrorDetail struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   any    `json:"param"`
	Code    int    `json:"code"`
}

// DrainRequest is the body of POST /vllm_hi/instances/{id}/drain: the
// instances to move the requests to (default: every other active instance
// serving the drained one's models).
type DrainRequest struct {
	To []string `json:"to,omitempty"`
	// Force drains the last active instance of a model (the model goes
	// offline: its requests answer 503 until an instance serves it).
	Force bool `json:"force,omitempty"`
}

// WakeRequest is the body of POST /vllm_hi/instances/{id}/wake (optional).
type WakeRequest struct {
	// Active makes the woken instance active: it serves its models'
	// requests again (default: standby, a migration target).
	Active bool `json:"active,omitempty"`
}

// DrainAnswer is the answer to a drain: its id, for the status.
type DrainAnswer struct {
	ID string `json:"drain_id"`
}

// DrainStatus is GET /vllm_hi/drains/{id}/status. State is running,
// succeeded (every request moved or finished, the instance retired) or
// failed (Error says why; the instance stays draining, its remaining
// requests finish where they are).
type DrainStatus struct {
	ID       string `json:"drain_id"`
	Instance string `json:"vllm_hi_id"`
	// Cause is drain (an operator's: the instance is retired at the end)
	// or stop (its agent is being stopped: the instance is not retired and
	// comes back active when it registers again).
	Cause   string   `json:"cause"`
	State   string   `json:"state"`
	Targets []string `json:"targets"`
	// Moved counts the requests moved by migration; Finished those that
	// ended on the instance meanwhile (non-streaming, or done before their
	// turn); Remaining those still on it.
	Moved     int      `json:"moved"`
	Finished  int      `json:"finished"`
	Remaining int      `json:"remaining"`
	Migration []string `json:"migrations"`
	// SourceKV: what came of the instance's KV at the end (the migration
	// status's source_kv values), with its note.
	SourceKV     string    `json:"source_kv,omitempty"`
	SourceKVNote string    `json:"source_kv_note,omitempty"`
	Error        string    `json:"error,omitempty"`
	CreatedAt    time.Time `json:"created_at"`
	FinishedAt   time.Time `json:"finished_at,omitempty"`
}

// Drain causes.
const (
	DrainCauseOperator = "drain"
	DrainCauseStop     = "stop"
)

// Ended reports whether the drain is over.
func (s DrainStatus) Ended() bool { return s.State != StateRunning }

// DrainList is GET /vllm_hi/drains, newest first.
type DrainList struct {
	Drains []DrainStatus `json:"drains"`
}

// RebalanceDecision is one move the Host's balancer chose: the longest
// running sequences (Filter) of Src go to Dst by a keep_source_active
// migration, for Reason (waiting_queue, kv_high, kv_spread; Detail has
// the figures).
type RebalanceDecision struct {
	At        time.Time `json:"at"`
	Model     string    `json:"model"`
	Src       string    `json:"src_vllm_hi_id"`
	Dst       string    `json:"dst_vllm_hi_id"`
	Reason    string    `json:"reason"`
	Detail    string    `json:"detail"`
	Filter    string    `json:"request_filter"`
	DryRun    bool      `json:"dry_run,omitempty"`
	Migration string    `json:"migration_id,omitempty"`
	Error     string    `json:"error,omitempty"`
}

// RebalanceStatus is GET /vllm_hi/rebalance: the balancer's settings and
// its latest decisions, newest first.
type RebalanceStatus struct {
	Enabled     bool                `json:"enabled"`
	DryRun      bool                `json:"dry_run"`
	IntervalS   float64             `json:"interval_s"`
	KVHigh      float64             `json:"kv_high"`
	WaitingHigh int                 `json:"waiting_high"`
	KVSpread    float64             `json:"kv_spread"`
	MaxRequests int                 `json:"max_requests"`
	CooldownS   float64             `json:"cooldown_s"`
	Decisions   []RebalanceDecision `json:"decisions"`
}

// AdminState is GET /admin/state: every switched model by alias.
type AdminState struct {
	Models map[string]SwitchedModel `json:"models"`
	// HostMemory is what level-1 sleepers hold in host memory, against
	// the controller's budget (absent without one).
	HostMemory *HostMemory `json:"host_memory,omitempty"`
}

// HostMemory is the level-1 sleepers' host memory and its budget.
type HostMemory struct {
	UsedGB   float64 `json:"used_gb"`
	BudgetGB float64 `json:"budget_gb"`
}

// SwitchedModel is one alias in GET /admin/state: its state (unknown,
// awake, sleeping, waking, sleeping_in_progress, error), its requests
// running (active) and waiting for it (queued), and the latest switch
// that woke it.
type SwitchedModel struct {
	State           string     `json:"state"`
	Active          int        `json:"active"`
	Queued          int        `json:"queued"`
	Group           string     `json:"group,omitempty"`
	ServedModelName string     `json:"served_model_name"`
	BackendURL      string     `json:"backend_url"`
	AwakeSince      *time.Time `json:"awake_since,omitempty"`
	PinnedUntil     *time.Time `json:"pinned_until,omitempty"`
	// SleepLevel is the level the model sleeps at (while it sleeps);
	// HostMemoryGB what its weights take in host memory at level 1.
	SleepLevel   int           `json:"sleep_level,omitempty"`
	HostMemoryGB float64       `json:"host_memory_gb,omitempty"`
	LastError    string        `json:"last_error,omitempty"`
	LastSwitch   *SwitchReport `json:"last_switch,omitempty"`
}

// SwitchReport is what one switch did, step by step.
type SwitchReport struct {
	Model     string    `json:"model"`
	From      string    `json:"from,omitempty"` // the model put to sleep
	State     string    `json:"state"`          // succeeded | failed
	Error     string    `json:"error,omitempty"`
	StartedAt time.Time `json:"started_at"`
	DurationS float64   `json:"duration_s"`
	// DrainS is how long draining the previous model took, Drain how it
	// was drained (its streams moved by migration, or waited for).
	DrainS float64      `json:"drain_s"`
	Drain  string       `json:"drain,omitempty"`
	Steps  []SwitchStep `json:"steps"`
}

// SwitchStep is one named step of a switch.
type SwitchStep struct {
	Step      string    `json:"step"`
	Model     string    `json:"model"`
	StartedAt time.Time `json:"started_at"`
	DurationS float64   `json:"duration_s"`
	Error     string    `json:"error,omitempty"`
}

// SwitchResult is POST /admin/switch/{model}'s answer.
type SwitchResult struct {
	Model     string        `json:"model"`
	State     string        `json:"state"`
	DurationS float64       `json:"duration_s"`
	Switch    *SwitchReport `json:"switch,omitempty"`
}

// PrewarmRequest is POST /admin/prewarm's body: wake the model and keep
// it awake for ttl_s.
type PrewarmRequest struct {
	Model string  `json:"model"`
	TTLS  float64 `json:"ttl_s"`
}

// PrewarmResult is its answer.
type PrewarmResult struct {
	Model       string    `json:"model"`
	State       string    `json:"state"`
	PinnedUntil time.Time `json:"pinned_until"`
}

// ScaleRequest is POST /vllm_hi/scale's body: an absolute target for one
// deployment, named by model or by instance.
type ScaleRequest struct {
	Model            string `json:"model,omitempty"`
	ID               string `json:"vllm_hi_id,omitempty"`
	DataParallelSize *int   `json:"data_parallel_size,omitempty"`
	Replicas         *int   `json:"replicas,omitempty"`
}

// ScaleAnswer is its answer.
type ScaleAnswer struct {
	ID string `json:"scale_id"`
}

// ScalePhase is one phase of a scale: prepare (the engine serves while it
// readies the target topology), commit (it answers 503: the Host holds
// requests), verify (the probe against the answer before).
//
// A replicas scale has launch, wake or standby (how each new replica was
// found), verify, activate and move phases out, and drain and stop in;
// Instance names the replica a phase was about.
type ScalePhase struct {
	Phase     string    `json:"phase"`
	Instance  string    `json:"vllm_hi_id,omitempty"`
	StartedAt time.Time `json:"started_at"`
	DurationS float64   `json:"duration_s"`
}

// ScaleStatus is GET /vllm_hi/scale/{id}/status.
type ScaleStatus struct {
	ID       string `json:"scale_id"`
	State    string `json:"state"`                // running, succeeded, failed, rolled_back
	Kind     string `json:"kind"`                 // elastic_ep, replicas
	Instance string `json:"vllm_hi_id,omitempty"` // elastic_ep: the instance scaled
	// Cause is operator (an API call) or autoscaler.
	Cause  string       `json:"cause,omitempty"`
	Model  string       `json:"model"`
	From   int          `json:"from"` // 0: not known (the Host had not scaled it before)
	To     int          `json:"to"`
	Phases []ScalePhase `json:"phases"`
	// DowntimeS is the commit as the Host saw it (first 503 → the engine's
	// answer); TotalS the whole operation.
	DowntimeS float64 `json:"downtime_s"`
	TotalS    float64 `json:"total_s"`
	// HeldRequests counts the requests held through the commit and sent
	// again instead of failing.
	HeldRequests int `json:"held_requests"`
	// Replicas scales: Instances are the model's active instances when
	// it ended, Added and Removed the replicas it brought in and took
	// out, Migrations the migrations and drains that moved streams, Moved
	// how many streams they moved.
	Instances  []string  `json:"instances,omitempty"`
	Added      []string  `json:"added,omitempty"`
	Removed    []string  `json:"removed,omitempty"`
	Migrations []string  `json:"migrations,omitempty"`
	Moved      int       `json:"moved,omitempty"`
	Error      string    `json:"error,omitempty"`
	CreatedAt  time.Time `json:"created_at"`
	FinishedAt time.Time `json:"finished_at,omitempty"`
}

// Ended says whether the operation is over.
func (s ScaleStatus) Ended() bool { return s.State != "" && s.State != StateRunning }

// ScaleList is GET /vllm_hi/scales.
type ScaleList struct {
	Scales []ScaleStatus `json:"scales"`
}

// AutoscaleDecision is one decision of the autoscaler: to scale a model
// out or in, why, what it read, and the scale operation it started.
type AutoscaleDecision struct {
	At        time.Time `json:"at"`
	Model     string    `json:"model"`
	Kind      string    `json:"kind"`      // replicas, data_parallel
	Direction string    `json:"direction"` // out, in
	From      int       `json:"from"`
	To        int       `json:"to"`
	Reason    string    `json:"reason"` // ttft_p95, queue_depth, ttft_low
	Detail    string    `json:"detail"`
	TTFTP95S  float64   `json:"ttft_p95_s"`
	Samples   int       `json:"samples"`
	Waiting   int       `json:"waiting"`
	ScaleID   string    `json:"scale_id,omitempty"`
	Error     string    `json:"error,omitempty"`
	DryRun    bool      `json:"dry_run,omitempty"`
}

// AutoscaleModel is the autoscaler's view of one model.
type AutoscaleModel struct {
	Model    string  `json:"model"`
	Kind     string  `json:"kind"`
	Size     int     `json:"size"`
	Min      int     `json:"min"`
	Max      int     `json:"max"`
	SLOS     float64 `json:"ttft_p95_slo_s"`
	TTFTP95S float64 `json:"ttft_p95_s"`
	Samples  int     `json:"samples"`
	Waiting  int     `json:"waiting"`
	// Scaling is the operation running for it; CoolingUntil when the
	// next decision may come.
	Scaling      string    `json:"scaling,omitempty"`
	CoolingUntil time.Time `json:"cooling_until,omitempty"`
}

// AutoscaleStatus is GET /vllm_hi/autoscale.
type AutoscaleStatus struct {
	Enabled   bool                `json:"enabled"`
	DryRun    bool                `json:"dry_run,omitempty"`
	Models    []AutoscaleModel    `json:"models"`
	Decisions []AutoscaleDecision `json:"decisions"`
}

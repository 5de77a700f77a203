// Package hooks is the engine-hook contract between a vhi agent and the
// engine it sits beside (vLLM with the vllm-hi plugin, or vhi sim). The
// hooks travel as JSON over the engine's own HTTP port under /vllm_hi/engine;
// docs/engine-hooks.md says how each one maps onto vLLM's internals.
package hooks

import (
	"context"
	"encoding/json"
	"fmt"
)

// Version is the hook contract version an engine reports in its layout.
const Version = 1

// HTTP paths of the hooks, relative to the engine's base URL.
const (
	PathLayout   = "/vllm_hi/engine/layout"
	PathRequests = "/vllm_hi/engine/requests"
	PathChanges  = "/vllm_hi/engine/changes" // GET ?since=CURSOR
	PathPause    = "/vllm_hi/engine/pause"
	PathResume   = "/vllm_hi/engine/resume"
	PathExport   = "/vllm_hi/engine/export"
	PathAllocate = "/vllm_hi/engine/install/allocate"
	PathInstall  = "/vllm_hi/engine/install/commit"
	// PathStage hands a target, before the pause, the state of requests it
	// is about to install (a snapshot the source exported while running):
	// whatever the target derives from a request's tokens alone (vLLM's
	// detokenizer replay) is done then, outside the pause.
	PathStage = "/vllm_hi/engine/install/stage"
	PathAbort = "/vllm_hi/engine/abort"
	PathStats = "/vllm_hi/engine/stats"
	// PathRetire releases the engine's KV memory once its requests
	// finished (the end of a destroy_source migration); PathWake brings
	// it back.
	PathRetire = "/vllm_hi/engine/retire"
	PathWake   = "/vllm_hi/engine/wake"
	// PathAttach streams a request's output from token index ?from=K as the
	// same OpenAI SSE chunks its original stream carries. A pre-attach
	// (?from=-1&wait_ms=N, PreAttachPath) is opened before the request is
	// installed: the engine waits up to N ms for the install, then streams
	// from the output index the request was installed at; an engine
	// without it refuses from=-1 (400), and the Host attaches afterwards.
	PathAttach = "/vllm_hi/engine/requests/{request_id}/stream"
)

// Engine is the hook surface. The sim implements it in process; the agent's
// HTTP client implements it against any engine that serves the hooks.
// Attach is HTTP-only (PathAttach) because it is a stream.
type Engine interface {
	Layout(ctx context.Context) (Layout, error)
	Requests(ctx context.Context) (RequestList, error)
	Changes(ctx context.Context, since uint64) (Changes, error)
	Pause(ctx context.Context, req PauseRequest) (PauseResponse, error)
	Resume(ctx context.Context, req ResumeRequest) (ResumeResponse, error)
	Export(ctx context.Context, req ExportRequest) (ExportResponse, error)
	Allocate(ctx context.Context, req AllocateRequest) (AllocateResponse, error)
	Install(ctx context.Context, req InstallRequest) (InstallResponse, error)
	Abort(ctx context.Context, req AbortRequest) (AbortResponse, error)
	Stats(ctx context.Context) (Stats, error)
	Retire(ctx context.Context, req RetireRequest) (RetireResponse, error)
	Wake(ctx context.Context) (WakeResponse, error)
}

// Memory kinds a region can be exported as.
const (
	MemoryShm     = "shm"      // a file (normally under /dev/shm) the agent mmaps
	MemoryCUDAIPC = "cuda_ipc" // a CUDA IPC handle of the base allocation + offset
)

// Geometry is the model-side shape of a whole model's KV cache, as the
// layout hook reports it (internal/kvlayout computes with it).
type Geometry struct {
	Layers     int    `json:"num_layers"`
	KVHeads    int    `json:"num_kv_heads"`
	HeadDim    int    `json:"head_dim"`
	DTypeBytes int    `json:"dtype_bytes"`
	DType      string `json:"dtype"`
	BlockSize  int    `json:"block_size"`
	NumBlocks  int    `json:"num_blocks"`
}

// Parallel is how the engine shards the model: tensor- and
// pipeline-parallel sizes.
type Parallel struct {
	TP int `json:"tp"`
	PP int `json:"pp"`
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

// Layout describes the engine's model geometry and where its KV lives.
type Layout struct {
	Engine        string   `json:"engine"` // "vhi-sim" or "vllm"
	EngineVersion string   `json:"engine_version"`
	HooksVersion  int      `json:"hooks_version"`
	Model         string   `json:"model"`
	ServedModels  []string `json:"served_model_names"`
	Geometry      Geometry `json:"geometry"`
	Parallel      Parallel `json:"parallel"`
	// KVLayout names each layer's KV tensor shape: "HND" (2, blocks,
	// heads, block_size, head_dim) or "NHD" (2, blocks, block_size, heads,
	// head_dim). The regions' strides say the same; copies follow those.
	KVLayout string `json:"kv_layout"`
	// OpaqueBlocks says a block's bytes are laid out by the engine in a
	// way the strides describe only as a whole: copy whole blocks, never
	// single token slots (vLLM's CPU attention tiles slots inside a block).
	OpaqueBlocks bool `json:"opaque_blocks,omitempty"`
	// StagesState says the engine prepares installs from a snapshot
	// handed to the stage hook before the pause, and exports snapshots of
	// running requests (export with snapshot): the Host stages the moving
	// requests on such a target while the source still decodes.
	StagesState bool `json:"stages_state,omitempty"`
	// KVGeneration changes whenever the engine re-creates its KV memory
	// (sleep and wake-up): a mapping made for another generation maps
	// memory the engine no longer uses. 0 when the engine does not say.
	KVGeneration uint64 `json:"kv_generation,omitempty"`
	// Regions is empty while the engine has no KV memory (it sleeps).
	Regions []Region `json:"regions"`
}

// Region is one rank × stage's KV memory. Its layout is fully strided: the
// HeadDim×dtype bytes of (local layer l, K/V kv, block b, local head h,
// slot s) start at
//
//	l*LayerStride + kv*KVStride + b*BlockStride + h*HeadStride + s*SlotStride
//
// so any of vLLM's physical layouts (per-layer FlashAttention tensors,
// 0.2x's cross-layer [L,B,H,N,C] permutations) can be described and copied.
type Region struct {
	TPRank      int    `json:"tp_rank"`
	PPStage     int    `json:"pp_stage"`
	FirstLayer  int    `json:"first_layer"`
	NumLayers   int    `json:"num_layers"`
	FirstHead   int    `json:"first_head"`
	NumHeads    int    `json:"num_heads"`
	Size        int64  `json:"size_bytes"`
	LayerStride int64  `json:"layer_stride"`
	KVStride    int64  `json:"kv_stride"`
	BlockStride int64  `json:"block_stride"`
	HeadStride  int64  `json:"head_stride"`
	SlotStride  int64  `json:"slot_stride"`
	Memory      Memory `json:"memory"`
}

// Memory says how an agent maps a region.
type Memory struct {
	Kind string `json:"kind"`
	// Shm: the file path. CUDA IPC: empty.
	Path string `json:"path,omitempty"`
	// CUDA IPC: device ordinal, base64 of the 64-byte cudaIpcMemHandle of the
	// base allocation, and the region's offset into it.
	Device int `json:"device,omitempty"`
	// DeviceUUID names the GPU absolutely ("GPU-…", as NVML prints it):
	// Device is an ordinal in the exporting process's numbering, which
	// CUDA_VISIBLE_DEVICES changes, so an agent that has it opens the
	// region on the GPU of this UUID in its own numbering. Empty: use
	// Device (exporters from before it).
	DeviceUUID string `json:"device_uuid,omitempty"`
	IPCHandle  string `json:"ipc_handle,omitempty"`
	Offset     int64  `json:"offset,omitempty"`
	// PID and DevicePointer let a copier in the exporting process itself
	// (an in-process stack: tests, benchmarks) use the allocation directly:
	// CUDA refuses to open a process's own IPC handles.
	PID int `json:"pid,omitempty"`
	// Node is the exporting machine's hostname: CUDA IPC handles open only
	// on the node that made them, so agents elsewhere use tcp_shm.
	Node          string `json:"node,omitempty"`
	DevicePointer uint64 `json:"device_pointer,omitempty"`
}

// Request statuses as the hooks report them.
const (
	StatusWaiting   = "waiting"
	StatusRunning   = "running"
	StatusPreempted = "preempted"
)

// RequestInfo is one live request as the scheduler sees it.
type RequestInfo struct {
	RequestID         string `json:"request_id"`
	Status            string `json:"status"`
	Paused            bool   `json:"paused"`
	NumPromptTokens   int    `json:"num_prompt_tokens"`
	NumOutputTokens   int    `json:"num_output_tokens"`
	NumComputedTokens int    `json:"num_computed_tokens"`
	// BlockIDs travel as an IntList (a plain array is accepted too): a
	// copy round's list of 256 requests read them inside the pause, and
	// as JSON numbers they were half of its bytes and most of its
	// encoding and decoding.
	BlockIDs    IntList `json:"block_ids"`
	ArrivalTime float64 `json:"arrival_time"`
	// Stream says the client is streaming: only streams can be spliced
	// onto another engine mid-way.
	Stream    bool `json:"stream"`
	MaxTokens int  `json:"max_tokens"`
	// Unmovable says why the request cannot move to another engine (""
	// when it can): its state is more than the hooks carry — on vLLM, a
	// structured-output request's grammar position. A migration leaves
	// it to finish where it runs; an install of it is refused (409).
	Unmovable string `json:"unmovable,omitempty"`
}

// RequestList is every live request plus the cursor they were read at.
type RequestList struct {
	Cursor      uint64        `json:"cursor"`
	Requests    []RequestInfo `json:"requests"`
	FreeBlocks  int           `json:"free_blocks"`
	TotalBlocks int           `json:"total_blocks"`
}

// BlockWrite says which token slots of a block were written since a cursor.
// Slots are written in order, so the changed slots are one range.
type BlockWrite struct {
	Block     int    `json:"block"`
	FirstSlot int    `json:"first_slot"`
	NumSlots  int    `json:"num_slots"`
	RequestID string `json:"request_id"`
}

// Changes is what happened to the KV between Since and Cursor.
type Changes struct {
	Since   uint64       `json:"since"`
	Cursor  uint64       `json:"cursor"`
	Written []BlockWrite `json:"written"`
	Freed   []int        `json:"freed"`
}

// PauseRequest pauses requests (all when RequestIDs is empty) at the next
// step boundary. They keep their blocks. If nobody resumes, exports or aborts
// them within LeaseMS, the engine resumes them by itself.
type PauseRequest struct {
	RequestIDs []string `json:"request_ids,omitempty"`
	LeaseMS    int      `json:"lease_ms,omitempty"`
	// IgnoreMissing pauses the named requests the engine still runs and
	// lists the others (they finished or their client left) in the
	// answer's Missing, instead of refusing the whole call: under load a
	// request ends at almost every step, and a pause of hundreds that
	// fails for one and is sent again can lose that race every time.
	IgnoreMissing bool `json:"ignore_missing,omitempty"`
	// RoundSince, where the engine core's channel serves the pause, asks
	// it to read the final copy round's inputs — the KV layout, the
	// request list and the changes since this cursor — at the boundary
	// where the pause took hold, for the agent to keep: the paused
	// requests write nothing after it, so the final round needs no read
	// of its own queued behind the pause's exports. Engines that do not
	// serve it ignore it; the agent then reads the inputs as before.
	RoundSince *uint64 `json:"round_since,omitempty"`
	// Export, where the engine core's channel serves the pause, asks it
	// to export the requests it paused in the same boundary, as the
	// export hook would (its OutputFrom applies; RequestIDs is ignored:
	// the paused ones), and answer the export as PauseResponse.Exported:
	// one call inside the pause instead of one per chunk of requests,
	// each waiting for the engine's loop behind the others. Engines that
	// do not serve it ignore it; the Host then exports as before.
	Export *ExportRequest `json:"export,omitempty"`
	// DropInFlight lets an engine with asynchronous scheduling pause at
	// the boundary where the call arrives instead of one step later: the
	// step in flight's work for the paused requests (one decode position
	// each, whose token nobody has received) is dropped, and whoever
	// continues a request computes that position again. Without it the
	// pause waits for that step's output. Engines without steps in
	// flight, or that do not know it, ignore it.
	DropInFlight bool `json:"drop_in_flight,omitempty"`
}

// PauseResponse answers once the engine is at a step boundary with the
// requests paused.
type PauseResponse struct {
	Paused []string `json:"paused"`
	// Missing, with IgnoreMissing, lists the named requests the engine no
	// longer had at the boundary; they were not paused.
	Missing        []string `json:"missing,omitempty"`
	Cursor         uint64   `json:"cursor"`
	LeaseExpiresAt float64  `json:"lease_expires_at"`
	// StepWaitS is how long the call waited for the step in flight to end.
	// The requests kept decoding (and their clients kept receiving tokens)
	// until then, so a migration's downtime starts after it.
	StepWaitS float64 `json:"step_wait_s"`
	// DroppedInFlight, with DropInFlight, counts the paused requests whose
	// step in flight was dropped.
	DroppedInFlight int `json:"dropped_in_flight,omitempty"`
	// Exported is the export of the paused requests a PauseRequest.Export
	// asked for (an ExportResponse), if the engine served it.
	Exported json.RawMessage `json:"exported,omitempty"`
}

// ResumeRequest resumes paused requests (all when empty).
type ResumeRequest struct {
	RequestIDs []string `json:"request_ids,omitempty"`
}

// ResumeResponse lists what was resumed.
type ResumeResponse struct {
	Resumed []string `json:"resumed"`
}

// SamplingParams are the parts of vLLM's SamplingParams a migrated request
// needs to continue exactly.
type SamplingParams struct {
	Temperature  float64  `json:"temperature"`
	TopP         float64  `json:"top_p"`
	Seed         int64    `json:"seed"` // the effective seed (generated when the client gave none)
	MaxTokens    int      `json:"max_tokens"`
	IgnoreEOS    bool     `json:"ignore_eos"`
	Stop         []string `json:"stop,omitempty"`
	StopTokenIDs []int    `json:"stop_token_ids,omitempty"`
}

// ResponseMeta is what the API server needs to keep a request's client
// stream looking the same after it moved: ids, kind, and usage options.
type ResponseMeta struct {
	Kind            string `json:"kind"` // "completion" or "chat"
	ResponseID      string `json:"response_id"`
	Model           string `json:"model"`
	Created         int64  `json:"created"`
	Stream          bool   `json:"stream"`
	IncludeUsage    bool   `json:"include_usage"`
	ContinuousUsage bool   `json:"continuous_usage"`
	// ReturnTokenIDs: the stream's chunks carry their token ids (vLLM's
	// return_token_ids), asked by the client or by the Host's relay.
	ReturnTokenIDs bool `json:"return_token_ids,omitempty"`
}

// RequestState is everything needed to continue a paused request elsewhere.
type RequestState struct {
	RequestID      string  `json:"request_id"`
	PromptTokenIDs IntList `json:"prompt_token_ids"`
	// OutputTokenIDs are the request's output tokens; with OutputFrom set
	// (an export asked for with ExportRequest.OutputFrom), those after the
	// first OutputFrom only, and the prompt, sampling parameters, text and
	// response metadata are left out: the target's stage has them.
	OutputTokenIDs    IntList        `json:"output_token_ids"`
	OutputFrom        int            `json:"output_from,omitempty"`
	NumComputedTokens int            `json:"num_computed_tokens"`
	Sampling          SamplingParams `json:"sampling_params"`
	// RNGPosition is how many random draws the sampler has made for this
	// request; vhi sim draws once per output token.
	RNGPosition int `json:"rng_position"`
	// OutputText is the detokenized output so far (after stop-string
	// truncation) and TextOffsets the visible text length after each output
	// token, so the target streams the same deltas. Offsets count Unicode
	// code points (Python's len; vhi sim's vocabulary is ASCII, so its byte
	// offsets are the same); the Host compares them with the text it
	// relayed to know when a client got everything the source produced.
	OutputText  string  `json:"output_text"`
	TextOffsets IntList `json:"text_offsets"`
	ArrivalTime float64 `json:"arrival_time"`
	Priority    int     `json:"priority"`
	// BlockIDs are the exporting engine's blocks (informational): an
	// install uses the blocks the target reserved for the request id and
	// ignores them, so the Host forwards an export to install untouched.
	BlockIDs IntList      `json:"block_ids"`
	Response ResponseMeta `json:"response"`
	// EngineState is engine-specific state carried opaquely from the
	// source's export to the target's install (vLLM: the full sampling
	// parameters, the random generator's state, the original prompt
	// length). Source and target run the same engine; the sim sends none.
	EngineState json.RawMessage `json:"engine_state,omitempty"`
}

// ExportRequest asks for the state of paused requests.
type ExportRequest struct {
	RequestIDs []string `json:"request_ids"`
	// Snapshot exports running (not paused) requests as they are now:
	// token ids and sampling state only, for the target's stage hook.
	Snapshot bool `json:"snapshot,omitempty"`
	// TokensOnly (with Snapshot) leaves out what only an engine's API
	// server knows (each stream's response metadata): a snapshot that
	// tops up a stage the target holds already. The vLLM plugin answers
	// it from its engine core, over the core channel.
	TokensOnly bool `json:"tokens_only,omitempty"`
	// OutputFrom (an export of paused requests): by request id, how many
	// of its output tokens the target holds staged already. An engine may
	// then export such a request as its output tokens after those alone
	// (RequestState.OutputFrom), with what a stage cannot know; the target
	// installs it over its stage. A hint: an engine that ignores it
	// exports whole states. The vLLM plugin's core channel takes it.
	OutputFrom map[string]int `json:"output_from,omitempty"`
}

// StageRequest is the stage hook's body: the requests' state as a
// snapshot export gave it (the Host passes it on as it came).
type StageRequest struct {
	Requests []json.RawMessage `json:"requests"`
}

// StageResponse names the requests the target prepared.
type StageResponse struct {
	Staged []string `json:"staged"`
}

// ExportResponse carries their state and the cursor it was read at.
type ExportResponse struct {
	Cursor   uint64         `json:"cursor"`
	Requests []RequestState `json:"requests"`
}

// AllocateRequest reserves blocks on the target for requests about to move.
// Unused reservations are freed when LeaseMS passes without an Install.
type AllocateRequest struct {
	Requests []AllocateItem `json:"requests"`
	LeaseMS  int            `json:"lease_ms,omitempty"`
	// Extend renews reservations this engine holds already rather than
	// making new ones: each item's reservation (by request id; its other
	// fields are ignored) is held for LeaseMS from now. Nothing is
	// allocated; the answer lists the reservations renewed, with their
	// blocks — one that is gone (expired, aborted, installed) is absent,
	// never an error. A warm standby holds its copies' reservations so.
	Extend bool `json:"extend,omitempty"`
}

// AllocateItem is one request's need.
type AllocateItem struct {
	RequestID string `json:"request_id"`
	NumTokens int    `json:"num_tokens"`
	// Recompute reserves the request id only, no blocks: its KV does not
	// move, its install brings the state alone, and the engine recomputes
	// the KV from the tokens when blocks free up, as it does for a
	// request it preempted (a target too small for every request's KV).
	// An engine that cannot do this refuses the item (400); one that can
	// says so in the answer's item.
	Recompute bool `json:"recompute,omitempty"`
	// SharedPrefix says that this request's first Blocks blocks hold the
	// same KV as those of an earlier item of the same call (a prompt
	// prefix the source's prefix cache shares between them): an engine
	// that shares blocks maps them to that item's blocks (one more
	// reference each) and allocates the rest, so that the migration moves
	// them once. An engine that does not allocates them all as usual;
	// the caller tells which it did from the block ids.
	SharedPrefix *SharedPrefix `json:"shared_prefix,omitempty"`
}

// SharedPrefix names an earlier item whose first Blocks blocks an
// allocation shares.
type SharedPrefix struct {
	RequestID string `json:"request_id"`
	Blocks    int    `json:"blocks"`
}

// AllocateResponse gives the target's block ids per request.
type AllocateResponse struct {
	Requests   []AllocatedItem `json:"requests"`
	FreeBlocks int             `json:"free_blocks"`
}

// AllocatedItem is one request's target blocks.
type AllocatedItem struct {
	RequestID string `json:"request_id"`
	BlockIDs  []int  `json:"block_ids"`
	// Recompute confirms a recompute reservation (no blocks).
	Recompute bool `json:"recompute,omitempty"`
}

// InstallRequest installs requests whose KV is already in the blocks that
// Allocate returned. With Resume they start decoding at once. Otherwise
// they wait for a Resume, which commits them; a migration installs them
// this way while its last KV is still being copied. Installed requests
// that no Resume commits within LeaseMS are dropped silently, blocks
// freed, not started: the source still has them.
type InstallRequest struct {
	Requests []RequestState `json:"requests"`
	Resume   bool           `json:"resume"`
	LeaseMS  int            `json:"lease_ms,omitempty"`
	// TextFrom is, by request id, where the Host's relay holds the
	// request's client stream (code points it got from the source): a
	// stream pre-attached on this engine opens with the moved text from
	// there, so that the switch after the commit only reads a connection
	// already open. For an engine that derives the moved text
	// (InstallResponse.VisibleText).
	TextFrom map[string]int `json:"text_from,omitempty"`
	// IDsFrom is, by request id, how many output token ids the held
	// client got with that text (where the relay knows them): the
	// pre-attached stream's first event carries the ids of the moved
	// tokens after those, so that a client that asked for token ids gets
	// each token's once across the switch.
	IDsFrom map[string]int `json:"ids_from,omitempty"`
	// Last says that no other install of the migration follows inside
	// the pause: an engine may wake the streams pre-attached to these
	// requests at once, rather than once installs stop coming, so that
	// their first events go out while the Host checks the copied KV.
	Last bool `json:"last,omitempty"`
}

// InstallResponse lists what was installed.
type InstallResponse struct {
	Installed []string `json:"installed"`
	// VisibleText is, by request id, how much text (code points) the
	// request's client had got once every moved output token went out —
	// where the Host's relay cuts the source's stream over. An engine that
	// derives the text itself (vLLM's detokenizer, replayed over the moved
	// token ids) says it here; absent, the Host reads it from the export's
	// text offsets.
	VisibleText map[string]int `json:"visible_text,omitempty"`
	// TextFrom echoes the InstallRequest.TextFrom entries the engine took:
	// their pre-attached streams open with the moved text from there.
	TextFrom map[string]int `json:"text_from,omitempty"`
}

// AbortRequest drops requests and frees their blocks. Silent aborts end the
// request's own client stream without a finish chunk (the Host carries the
// client on elsewhere); loud ones finish it with finish_reason "abort".
// Requests only allocated (not installed) are released too.
type AbortRequest struct {
	RequestIDs []string `json:"request_ids"`
	Silent     bool     `json:"silent"`
	// IgnoreMissing skips ids the engine no longer has (they finished or
	// their client left) instead of refusing the whole call.
	IgnoreMissing bool `json:"ignore_missing,omitempty"`
	// ReservedOnly drops only the named requests that hold a reservation
	// or an install not yet committed (what a migration that did not
	// commit left on its target), and leaves a running request alone: a
	// Host cleaning up after a restart cannot tell from its records alone
	// whether a commit reached the engine.
	ReservedOnly bool `json:"reserved_only,omitempty"`
}

// AbortResponse lists what was aborted.
type AbortResponse struct {
	Aborted []string `json:"aborted"`
}

// Stats is the engine's block accounting.
type Stats struct {
	Cursor         uint64 `json:"cursor"`
	TotalBlocks    int    `json:"total_blocks"`
	FreeBlocks     int    `json:"free_blocks"`
	UsedBlocks     int    `json:"used_blocks"`
	ReservedBlocks int    `json:"reserved_blocks"`
	NumRunning     int    `json:"num_running"`
	NumWaiting     int    `json:"num_waiting"`
	NumPaused      int    `json:"num_paused"`
	PausedAll      bool   `json:"paused_all"`
	Sleeping       bool   `json:"sleeping"`
	Steps          uint64 `json:"steps"`
}

// RetireRequest asks the engine to give its KV memory back once the
// requests still on it finished, waiting at most WaitS seconds for them
// (requests that have not finished by then keep running, and nothing is
// released).
type RetireRequest struct {
	WaitS float64 `json:"wait_s"`
}

// RetireResponse says what was released. An engine that cannot release
// its KV (no sleep mode) answers Released false with the reason.
type RetireResponse struct {
	Released      bool   `json:"released"`
	ReleasedBytes int64  `json:"released_bytes"`
	Note          string `json:"note,omitempty"`
}

// WakeResponse answers a wake-up: the engine's KV is usable again.
type WakeResponse struct {
	Note string `json:"note,omitempty"`
}

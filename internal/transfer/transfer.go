// Package transfer is what every KV data plane shares: the backends'
// names, the Backend interface the agent moves a copy round through, one
// Pick that decides which backend moves a round, the round planner (what
// a round copies), and the Stats and Fault every backend reports and
// takes. Each backend is a folder of its own: tcpshm (TCP into shared
// memory, staged through pinned host memory for GPU KV), cudaipc (GPU to
// GPU on one node), rdma (UCX puts, on RDMA NICs where they exist and on
// UCX's TCP and shared-memory transports elsewhere).
package transfer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// Backend names (VLLM_HI_TRANSFER_BACKEND, --transfer-backend, and the
// Host's instance records).
const (
	Auto    = "auto"
	TCPShm  = "tcp_shm"
	CUDAIPC = "cuda_ipc"
	RDMA    = "rdma"
	// UCX is accepted for rdma (what NIXL and UCX users call it).
	UCX = "ucx"
)

// Names are the values --transfer-backend accepts.
func Names() []string { return []string{Auto, TCPShm, CUDAIPC, RDMA, UCX} }

// Canonical is a backend name with its alias resolved.
func Canonical(name string) string {
	if name == UCX {
		return RDMA
	}
	return name
}

// RDMAPlane is what an agent reports of its rdma data plane.
type RDMAPlane struct {
	Devices  []string // devices with an RDMA transport (none: UCX over TCP and shared memory)
	Hostname string   // the agent's machine
}

// RDMAPeers are the two agents' rdma data planes (nil: that agent has
// none, UCX is not installed there).
type RDMAPeers struct {
	Source, Target *RDMAPlane
}

// acrossNodes reports whether both agents said where they run and it is
// not the same machine.
func (p RDMAPeers) acrossNodes() bool {
	return p.Source != nil && p.Target != nil && p.Source.Hostname != "" && p.Target.Hostname != "" && p.Source.Hostname != p.Target.Hostname
}

// Stats describe one move.
type Stats struct {
	Runs     int
	Bytes    int64
	Duration time.Duration
}

// Fault injects a failure into a move, for tests of the abort paths.
type Fault int

// Faults.
const (
	NoFault      Fault = iota
	CorruptFrame       // damage bytes in flight after checksumming: the target must notice
	CutConn            // fail the move halfway
	// CorruptSilently moves wrong bytes that arrive "intact", as a bug or
	// bad memory would: only the end-to-end check of the moved blocks can
	// notice.
	CorruptSilently
)

// ParseFault reads a migrate request's inject_fault as a data-plane fault
// ("" and faults that are not the data plane's are NoFault).
func ParseFault(s string) Fault {
	switch s {
	case "corrupt":
		return CorruptFrame
	case "cut":
		return CutConn
	case "silent_corrupt":
		return CorruptSilently
	}
	return NoFault
}

// Target is where a round goes: the target agent's data address and the
// migration's session there, authenticated with its secret.
type Target struct {
	Addr    string
	Session string
	Secret  []byte
	TLS     bool // the target's data plane speaks TLS
}

// Round is one copy round as a backend moves it.
type Round struct {
	Target   Target
	Src, Dst hooks.Layout
	Copies   []kvlayout.BlockCopy // sorted by source block
	// SlotGranular: the copies name token slots, not whole blocks.
	SlotGranular bool
	TN           int // parallel connections, for backends that use them
	Fault        Fault
	// SrcMemory is the source's KV regions mapped, when they are host
	// memory (nil for GPU KV).
	SrcMemory [][]byte
	// Pace, when set, spreads the round over the source's steps: a
	// backend that honours it (tcp_shm) takes each frame's bytes from it
	// before sending them; the others ignore it (the agent paces their
	// rounds by sending them in chunks).
	Pace Pacer
}

// Pacer hands out a round's bytes as the source can spare the time to
// send them (the agent's step pacer). Take returns when n more bytes may
// go, or with ctx's error.
type Pacer interface {
	Take(ctx context.Context, n int64) error
}

// Backend moves rounds of KV from this agent's engine to a target.
type Backend interface {
	Name() string
	Send(ctx context.Context, r Round) (Stats, error)
}

// ErrUnsupported: the backend asked for cannot move KV between these two
// engines.
var ErrUnsupported = errors.New("the transfer backend cannot move this KV")

// Pick decides which backend moves a round between src and dst, given
// the agent's --transfer-backend (want) and the two agents' rdma planes:
// cuda_ipc when both sides' KV is in GPU memory on this node (IPC handles
// only open there); rdma across machines when both agents have an RDMA
// device; tcp_shm otherwise (staged through pinned host memory on a GPU
// side). The reason says why, in words an operator reads in the
// migration's status.
func Pick(want string, src, dst hooks.Layout, peers RDMAPeers) (name, reason string, err error) {
	sg, dg := OnGPU(src), OnGPU(dst)
	local := SameNode(src) && SameNode(dst) && !peers.acrossNodes()
	switch Canonical(want) {
	case "", Auto:
		switch {
		case sg && dg && local:
			return CUDAIPC, "auto: both engines' KV is in GPU memory on this node", nil
		case !local && peers.Source != nil && peers.Target != nil && len(peers.Source.Devices) > 0 && len(peers.Target.Devices) > 0:
			return RDMA, fmt.Sprintf("auto: the engines are on different machines and both agents have RDMA devices (%s → %s)%s",
				strings.Join(peers.Source.Devices, ","), strings.Join(peers.Target.Devices, ","), stagedNote(sg, dg)), nil
		case sg && dg:
			return TCPShm, "auto: the engines' GPUs are on different nodes (CUDA IPC does not cross machines): staged through pinned host memory", nil
		case sg || dg:
			return TCPShm, "auto: one engine's KV is in host memory: the GPU side staged through pinned host memory", nil
		}
		return TCPShm, "auto: both engines' KV is in host memory", nil
	case TCPShm:
		return TCPShm, "asked for (--transfer-backend tcp_shm)", nil
	case CUDAIPC:
		switch {
		case !(sg && dg):
			return "", "", fmt.Errorf("%w: cuda_ipc needs both engines' KV in GPU memory", ErrUnsupported)
		case !local:
			return "", "", fmt.Errorf("%w: cuda_ipc needs both engines on this node (CUDA IPC handles do not cross machines)", ErrUnsupported)
		}
		return CUDAIPC, "asked for (--transfer-backend cuda_ipc)", nil
	case RDMA:
		switch {
		case peers.Source == nil:
			return "", "", fmt.Errorf("%w: rdma is unavailable on the source agent: libucp not found (install UCX)", ErrUnsupported)
		case peers.Target == nil:
			return "", "", fmt.Errorf("%w: the target agent has no rdma data plane (libucp not found there)", ErrUnsupported)
		}
		over := "UCX over TCP and shared memory (no RDMA device on the source)"
		if len(peers.Source.Devices) > 0 {
			over = "UCX on " + strings.Join(peers.Source.Devices, ",")
		}
		return RDMA, "asked for (--transfer-backend rdma): " + over + stagedNote(sg, dg), nil
	}
	return "", "", fmt.Errorf("%w: unknown transfer backend %q (want one of %v)", ErrUnsupported, want, Names())
}

// stagedNote says which side of an rdma round goes through pinned host
// memory (GPU KV, with a UCX that cannot reach GPU memory itself).
func stagedNote(sg, dg bool) string {
	switch {
	case sg && dg:
		return "; both GPU sides staged through pinned host memory"
	case sg:
		return "; the source's GPU KV staged through pinned host memory"
	case dg:
		return "; the target's GPU KV staged through pinned host memory"
	}
	return ""
}

// OnGPU reports whether any of l's regions is GPU memory.
func OnGPU(l hooks.Layout) bool {
	for _, r := range l.Regions {
		if r.Memory.Kind == hooks.MemoryCUDAIPC {
			return true
		}
	}
	return false
}

// SameNode reports whether every GPU region of l was exported on this
// machine (regions that do not say are taken as local).
func SameNode(l hooks.Layout) bool {
	here, _ := os.Hostname()
	for _, r := range l.Regions {
		if r.Memory.Kind == hooks.MemoryCUDAIPC && r.Memory.Node != "" && r.Memory.Node != here {
			return false
		}
	}
	return true
}

// Specs are l's regions as the copy planner reads them.
func Specs(l hooks.Layout) []kvlayout.RegionSpec {
	out := make([]kvlayout.RegionSpec, len(l.Regions))
	for i, r := range l.Regions {
		out[i] = kvlayout.RegionSpec{FirstLayer: r.FirstLayer, NumLayers: r.NumLayers, FirstHead: r.FirstHead, NumHeads: r.NumHeads,
			Strides: kvlayout.Strides{Layer: r.LayerStride, KV: r.KVStride, Block: r.BlockStride, Head: r.HeadStride, Slot: r.SlotStride}}
	}
	return out
}

package e2e

import (
	"os"
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/transfer/rdma"
	"github.com/vllm-hi/vllm-hi/test/framework"
)

// requireUCX skips where libucp cannot be loaded, unless VHI_REQUIRE_UCX
// is set (make test sets it: CI installs UCX, so there the tests run).
func requireUCX(t *testing.T) {
	t.Helper()
	l, err := rdma.Load()
	if err != nil {
		if os.Getenv("VHI_REQUIRE_UCX") != "" {
			t.Fatalf("VHI_REQUIRE_UCX is set: %v", err)
		}
		t.Skip(err)
	}
	l.Close()
}

// The agents move KV over the rdma data plane: UCX over its TCP and
// shared-memory transports here (no RDMA NIC), the same code path and
// API as over verbs. Every stream exact, and the data-plane faults roll
// back as on tcp_shm.
func TestRDMAMigrations(t *testing.T) {
	requireUCX(t)
	t.Setenv("VLLM_HI_TRANSFER_BACKEND", "rdma") // the agents read it (they inherit this process's environment)
	framework.Run(t, func(t *testing.T, o framework.Options) framework.Cluster {
		d := deployWith(t, deployOptions{bBlocks: 4096, aArgs: shapeArgs(o.A), bArgs: shapeArgs(o.B)})
		d.client = hostClient(t, d.hostURL, d.tk.admin)
		return d
	}, framework.RDMACases())
}

// The target's agent dies right after it accepted a migration over rdma:
// the migration aborts, A resumes, every stream is exact.
func TestRDMATargetAgentDies(t *testing.T) {
	requireUCX(t)
	t.Setenv("VLLM_HI_TRANSFER_BACKEND", "ucx") // the alias
	targetAgentDies(t)
}

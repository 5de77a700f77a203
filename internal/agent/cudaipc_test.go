package agent

import (
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

func TestPickBackend(t *testing.T) {
	host := hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryShm}}}}
	gpu := hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC, IPCHandle: "x"}}}}
	far := hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC, IPCHandle: "x", Node: "another-node.example"}}}}
	for _, c := range []struct {
		want     string
		src, dst hooks.Layout
		expect   string // backend, or a piece of the error
	}{
		{"auto", host, host, "tcp_shm"},
		{"", gpu, gpu, "cuda_ipc"},
		{"auto", gpu, gpu, "cuda_ipc"},
		{"cuda_ipc", gpu, gpu, "cuda_ipc"},
		{"tcp_shm", host, host, "tcp_shm"},
		{"cuda_ipc", host, host, "needs both engines' KV in GPU memory"},
		{"auto", gpu, host, "tcp_shm"}, // staged through pinned memory
		{"auto", host, gpu, "tcp_shm"},
		{"tcp_shm", gpu, gpu, "tcp_shm"},
		{"rdma", host, host, "not implemented"},
		{"auto", gpu, far, "tcp_shm"}, // another node: no IPC
		{"cuda_ipc", gpu, far, "this node"},
	} {
		a := &Agent{cfg: Config{TransferBackend: c.want}}
		got, err := a.pickBackend(c.src, c.dst)
		if err != nil {
			got = err.Error()
		}
		if !strings.Contains(got, c.expect) {
			t.Errorf("%q %s→%s: %q, want %q", c.want, memKind(c.src), memKind(c.dst), got, c.expect)
		}
	}
}

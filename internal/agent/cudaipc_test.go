package agent

import (
	"errors"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
)

// visibleGPUs is a driver that sees the GPUs of these UUIDs (by ordinal)
// and opens nothing.
type visibleGPUs struct {
	cuda.Driver
	uuids  []string
	opened int
}

func (v *visibleGPUs) DeviceCount() (int, error) { return len(v.uuids), nil }
func (v *visibleGPUs) DeviceUUID(dev int) (string, error) {
	if dev >= len(v.uuids) {
		return "", errors.New("no such device")
	}
	return v.uuids[dev], nil
}

func (v *visibleGPUs) IPCOpen(int, cuda.IPCHandle) (cuda.DevicePtr, error) {
	v.opened++
	return 0, errors.New("not here")
}

// cuda_ipc needs this agent to see both engines' GPUs. Chosen by auto, a
// round whose target GPU it cannot see goes through tcp_shm instead, and
// says why; asked for, it is refused before anything moves.
func TestCUDAIPCNeedsBothGPUsVisible(t *testing.T) {
	f := &visibleGPUs{uuids: []string{"GPU-aaaa"}}
	// Layouts of GPU KV on this node, named by UUID below.
	ipc := func() hooks.Layout {
		return hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC}}}}
	}
	src, dst := ipc(), ipc()
	src.Regions[0].Memory.DeviceUUID = "GPU-aaaa"
	for _, tc := range []struct {
		want, dstGPU, name, why string
	}{
		{transfer.Auto, "GPU-aaaa", transfer.CUDAIPC, "auto: both engines' KV is in GPU memory"},
		{transfer.Auto, "GPU-bbbb", transfer.TCPShm, "GPU-bbbb (its device 0) is not visible to this agent"},
		{transfer.CUDAIPC, "GPU-aaaa", transfer.CUDAIPC, "asked for"},
		{transfer.CUDAIPC, "GPU-bbbb", "", ""},
	} {
		a := &Agent{log: zap.NewNop(), cfg: Config{TransferBackend: tc.want},
			gpu: cudaipc.NewPlane(zap.NewNop(), func() (cuda.Driver, error) { return f, nil })}
		dst.Regions[0].Memory.DeviceUUID = tc.dstGPU
		name, why, err := a.pickBackend(src, dst, transfer.RDMAPeers{})
		if tc.name == "" {
			if !errors.Is(err, transfer.ErrUnsupported) || !strings.Contains(err.Error(), "GPU-bbbb") {
				t.Errorf("%s to an unseen GPU: %q, %v; want refused, naming the GPU", tc.want, name, err)
			}
			continue
		}
		if err != nil || name != tc.name || !strings.Contains(why, tc.why) {
			t.Errorf("%s to %s: %q (%s), %v; want %s, saying %q", tc.want, tc.dstGPU, name, why, err, tc.name, tc.why)
		}
	}
	if f.opened != 0 {
		t.Fatalf("choosing a data plane opened %d mappings", f.opened)
	}
}

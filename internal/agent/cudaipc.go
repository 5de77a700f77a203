package agent

import (
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"sync"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// gpuPlane is the agent's CUDA state, made on first use: the driver and a
// stream per device. IPC mappings are opened per copy round and closed at
// its end, so no mapping outlives the round (an engine may free its KV —
// sleep, shutdown — right after a migration).
type gpuPlane struct {
	mu      sync.Mutex
	drv     *cuda.Lib
	streams map[int]cuda.Stream
}

func (g *gpuPlane) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.drv == nil {
		return
	}
	for dev, s := range g.streams {
		_ = g.drv.DestroyStream(dev, s)
	}
	g.drv.Close()
	g.drv, g.streams = nil, nil
}

func onGPU(l hooks.Layout) bool {
	for _, r := range l.Regions {
		if r.Memory.Kind == hooks.MemoryCUDAIPC {
			return true
		}
	}
	return false
}

// pickBackend decides how a round moves bytes: cuda_ipc when both sides'
// KV is in GPU memory (same node: IPC handles only open there), tcp_shm
// when both are shared-memory files.
func (a *Agent) pickBackend(src, dst hooks.Layout) (string, error) {
	want := a.cfg.TransferBackend
	sg, dg := onGPU(src), onGPU(dst)
	switch {
	case want == "rdma":
		return "", errors.New("the rdma backend is not implemented (no RDMA NIC to build it against)")
	case sg && dg && (want == "" || want == "auto" || want == cudaipc.Type):
		return cudaipc.Type, nil
	case !sg && !dg && (want == "" || want == "auto" || want == "tcp_shm"):
		return "tcp_shm", nil
	case want == cudaipc.Type:
		return "", errors.New("cuda_ipc needs both engines' KV in GPU memory")
	default:
		return "", fmt.Errorf("%s cannot move KV between %s and %s memory (tcp_shm with GPU KV, staged through pinned host memory, is not implemented yet)",
			orAuto(want), memKind(src), memKind(dst))
	}
}

func orAuto(s string) string {
	if s == "" {
		return "auto"
	}
	return s
}

func memKind(l hooks.Layout) string {
	if onGPU(l) {
		return "GPU"
	}
	return "host"
}

// openRegions maps a layout's regions into dev's context.
func openRegions(drv *cuda.Lib, dev int, l hooks.Layout) (cudaipc.Regions, func(), error) {
	var opened []cuda.DevicePtr
	closeAll := func() {
		for _, p := range opened {
			_ = drv.IPCClose(dev, p)
		}
	}
	out := make(cudaipc.Regions, len(l.Regions))
	for i, r := range l.Regions {
		if r.Memory.PID == os.Getpid() && r.Memory.DevicePointer != 0 {
			// Our own allocation (an in-process stack): CUDA will not open
			// it through IPC, and needs no mapping.
			if err := drv.EnablePeer(dev, r.Memory.Device); err != nil {
				closeAll()
				return nil, nil, err
			}
			out[i] = cuda.DevicePtr(r.Memory.DevicePointer) + cuda.DevicePtr(r.Memory.Offset)
			continue
		}
		raw, err := base64.StdEncoding.DecodeString(r.Memory.IPCHandle)
		var h cuda.IPCHandle
		if err != nil || len(raw) != len(h) {
			closeAll()
			return nil, nil, fmt.Errorf("region %d: bad IPC handle", i)
		}
		copy(h[:], raw)
		p, err := drv.IPCOpen(dev, h)
		if err != nil {
			closeAll()
			return nil, nil, fmt.Errorf("open region %d (GPU %d) through IPC: %w", i, r.Memory.Device, err)
		}
		opened = append(opened, p)
		out[i] = p + cuda.DevicePtr(r.Memory.Offset)
	}
	return out, closeAll, nil
}

// cudaCopy runs one round's copies GPU to GPU: the plan's runs, from the
// source engine's regions to the target's, issued from the source GPU.
func (a *Agent) cudaCopy(src, dst hooks.Layout, copies []kvlayout.BlockCopy, fault tcpshm.Fault) (tcpshm.Stats, error) {
	geo := src.Geometry
	runs, err := kvlayout.Plan(geo.Layers, geo.KVHeads, int64(geo.HeadSlotBytes()), specs(src), specs(dst), copies)
	if err != nil {
		return tcpshm.Stats{}, err
	}
	g := &a.gpu
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.drv == nil {
		if g.drv, err = cuda.Load(); err != nil {
			return tcpshm.Stats{}, fmt.Errorf("cuda_ipc: %w", err)
		}
		g.streams = map[int]cuda.Stream{}
	}
	dev := src.Regions[0].Memory.Device
	s, ok := g.streams[dev]
	if !ok {
		if s, err = g.drv.NewStream(dev); err != nil {
			return tcpshm.Stats{}, err
		}
		g.streams[dev] = s
	}
	srcPtrs, closeSrc, err := openRegions(g.drv, dev, src)
	if err != nil {
		return tcpshm.Stats{}, err
	}
	defer closeSrc()
	dstPtrs, closeDst, err := openRegions(g.drv, dev, dst)
	if err != nil {
		return tcpshm.Stats{}, err
	}
	defer closeDst()
	c := &cudaipc.Copier{Driver: g.drv, Device: dev, Stream: s}
	if fault != tcpshm.NoFault {
		// Tests of a copy failing halfway: half the runs land, then the
		// round fails and the migration must roll back.
		if err := c.Run(srcPtrs, dstPtrs, runs[:len(runs)/2]); err != nil {
			return tcpshm.Stats{}, err
		}
		return tcpshm.Stats{}, errors.New("cuda_ipc: injected fault: copy failed halfway")
	}
	if err := c.Run(srcPtrs, dstPtrs, runs); err != nil {
		return tcpshm.Stats{}, err
	}
	return tcpshm.Stats{Runs: len(runs), Bytes: kvlayout.Bytes(runs)}, nil
}

package cudaipc

import (
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// loadedPlane is a plane whose driver is d, loaded, with a stream on each
// of its first devices.
func loadedPlane(d cuda.Driver, devices int) *Plane {
	g := NewPlane(zap.NewNop(), func() (cuda.Driver, error) { return d, nil })
	g.mu.Lock()
	defer g.mu.Unlock()
	if err := g.load(); err != nil {
		panic(err)
	}
	for dev := 0; dev < devices; dev++ {
		g.streams[dev] = cuda.Stream(dev + 1)
	}
	return g
}

// fakeGPU is a driver whose IPC mappings are counted and whose copies are
// recorded, for the plane's mapping lifecycle.
type fakeGPU struct {
	cuda.Driver
	opened, closed int
	live           map[cuda.DevicePtr]bool
	copies         int
	failCopy       bool
	uuids          []string // by ordinal, in the agent's numbering
	copyDevs       []int    // the device of each KernelCopy
}

func (f *fakeGPU) DeviceCount() (int, error) { return len(f.uuids), nil }
func (f *fakeGPU) DeviceUUID(dev int) (string, error) {
	if dev >= len(f.uuids) {
		return "", errors.New("no such device")
	}
	return f.uuids[dev], nil
}

// Staging for the integrity check: host memory stands in for both.
func (f *fakeGPU) HostAlloc(_ int, n uint64) ([]byte, error) { return nil, nil }
func (f *fakeGPU) HostFree(int, []byte) error                { return nil }
func (f *fakeGPU) Alloc(int, uint64) (cuda.DevicePtr, error) { return 1 << 50, nil }
func (f *fakeGPU) Free(int, cuda.DevicePtr) error            { return nil }

func (f *fakeGPU) IPCOpen(int, cuda.IPCHandle) (cuda.DevicePtr, error) {
	f.opened++
	p := cuda.DevicePtr(f.opened) << 40
	f.live[p] = true
	return p, nil
}

func (f *fakeGPU) IPCClose(_ int, p cuda.DevicePtr) error {
	if !f.live[p] {
		return errors.New("closing a mapping that is not open")
	}
	delete(f.live, p)
	f.closed++
	return nil
}

func (f *fakeGPU) KernelCopyFill(dev int, s cuda.Stream, n int, fill func([]cuda.Copy)) error {
	return f.KernelCopy(dev, s, cuda.FilledCopies(n, fill))
}

func (f *fakeGPU) KernelCopy(dev int, _ cuda.Stream, cs []cuda.Copy) error {
	f.copyDevs = append(f.copyDevs, dev)
	if f.failCopy {
		return errors.New("copy failed")
	}
	for _, c := range cs {
		if !f.live[c.Src&^(1<<40-1)] || !f.live[c.Dst&^(1<<40-1)] {
			return fmt.Errorf("copy %x→%x outside the open mappings", c.Src, c.Dst)
		}
	}
	f.copies += len(cs)
	return nil
}

func (f *fakeGPU) Sync(int, cuda.Stream) error { return nil }

func gpuLayout(t *testing.T, handle byte) hooks.Layout {
	t.Helper()
	geo := kvlayout.Geometry{Layers: 2, KVHeads: 2, HeadDim: 8, DTypeBytes: 2, BlockSize: 4, NumBlocks: 8}
	rl := kvlayout.NewRegionLayout(geo, kvlayout.Shard{TPSize: 1, PPSize: 1})
	h := make([]byte, len(cuda.IPCHandle{}))
	h[0] = handle
	return hooks.Layout{Geometry: geo, Parallel: kvlayout.Parallel{TP: 1, PP: 1}, Regions: []hooks.Region{{
		NumLayers: 2, NumHeads: 2, Size: rl.Size(), LayerStride: rl.LayerStride(), KVStride: rl.KVStride(),
		BlockStride: rl.BlockStride(), HeadStride: rl.HeadStride(), SlotStride: int64(geo.HeadSlotBytes()),
		Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC, IPCHandle: base64.StdEncoding.EncodeToString(h)},
	}}}
}

// A migration's IPC mappings open at its first cuda_ipc round, serve the
// next ones and the check after the final round, and close after a failed
// round, a release, or when left idle; a changed layout re-opens them.
func TestCUDAMappingsLiveForAMigration(t *testing.T) {
	f := &fakeGPU{live: map[cuda.DevicePtr]bool{}}
	g := loadedPlane(f, 1)
	src, dst := gpuLayout(t, 1), gpuLayout(t, 2)
	copies := []kvlayout.BlockCopy{{Src: 1, Dst: 5, NumSlots: 4}, {Src: 2, Dst: 6, NumSlots: 4}}
	round := func(session string, s, d hooks.Layout) error {
		_, err := g.Copy(session, s, d, copies, transfer.NoFault)
		return err
	}
	for i := 0; i < 4; i++ {
		if err := round("m1", src, dst); err != nil {
			t.Fatal(err)
		}
	}
	if f.opened != 2 || f.closed != 0 || f.copies == 0 {
		t.Fatalf("four rounds: opened %d, closed %d, copies %d; want 2 mappings kept open", f.opened, f.closed, f.copies)
	}
	g.Release("m1")
	if f.opened != 2 || len(f.live) != 0 {
		t.Fatalf("after the Host released the migration: opened %d, %d still open", f.opened, len(f.live))
	}

	// A changed target layout (the engine re-allocated its KV) re-opens.
	_ = round("m2", src, dst)
	_ = round("m2", src, gpuLayout(t, 3))
	if f.opened != 6 || len(f.live) != 2 {
		t.Fatalf("after a layout change: opened %d, %d open; want 6 and 2", f.opened, len(f.live))
	}
	g.Release("m2")
	if len(f.live) != 0 {
		t.Fatalf("%d mappings open after the Host released the migration", len(f.live))
	}

	// A failed round closes them.
	_ = round("m3", src, dst)
	f.failCopy = true
	if err := round("m3", src, dst); err == nil {
		t.Fatal("a failing copy reported success")
	}
	f.failCopy = false
	if len(f.live) != 0 {
		t.Fatalf("%d mappings open after a failed round", len(f.live))
	}

	// Mappings a migration left idle (its Host died) close on another's round.
	_ = round("m4", src, dst)
	g.pairs["m4"].used = time.Now().Add(-2 * MappingIdle)
	_ = round("m5", src, dst)
	if _, ok := g.pairs["m4"]; ok || len(f.live) != 2 {
		t.Fatalf("idle mappings not closed: %d open", len(f.live))
	}
}

// A cuda_ipc round never hands the kernel a run outside the engines'
// regions, or a copy outside their pools.
func TestCUDARunsAreBounded(t *testing.T) {
	src, dst := gpuLayout(t, 1), gpuLayout(t, 2)
	ok := []kvlayout.BlockCopy{{Src: 1, Dst: 5, NumSlots: 4}}
	runs, err := kvlayout.Plan(src.Geometry.Layers, src.Geometry.KVHeads, int64(src.Geometry.HeadSlotBytes()), transfer.Specs(src), transfer.Specs(dst), ok)
	if err != nil {
		t.Fatal(err)
	}
	if err := checkRuns(src, dst, ok, runs); err != nil {
		t.Fatal(err)
	}
	past := append([]kvlayout.CopyRun(nil), runs...)
	past[0].DstOffset = dst.Regions[0].Size - 1
	if checkRuns(src, dst, ok, past) == nil {
		t.Fatal("a run past the target's region passed")
	}
	if checkRuns(src, dst, []kvlayout.BlockCopy{{Src: 1, Dst: dst.Geometry.NumBlocks, NumSlots: 4}}, runs) == nil {
		t.Fatal("a copy outside the target's pool passed")
	}
}

// A layout names its GPU by UUID as well as by the exporter's ordinal
// (which CUDA_VISIBLE_DEVICES renumbers): the plane copies on the GPU of
// that UUID in its process's numbering, and refuses, opening nothing, a GPU it
// cannot see.
func TestCUDARegionsAreFoundByGPUUUID(t *testing.T) {
	f := &fakeGPU{live: map[cuda.DevicePtr]bool{}, uuids: []string{"GPU-aaaa", "GPU-bbbb"}}
	g := loadedPlane(f, 2)
	src, dst := gpuLayout(t, 1), gpuLayout(t, 2)
	// Each engine was started with CUDA_VISIBLE_DEVICES=1: its GPU is its
	// device 0, and the agent's device 1.
	src.Regions[0].Memory.DeviceUUID, dst.Regions[0].Memory.DeviceUUID = "GPU-bbbb", "GPU-bbbb"
	copies := []kvlayout.BlockCopy{{Src: 1, Dst: 5, NumSlots: 4}}
	if _, err := g.Copy("m1", src, dst, copies, transfer.NoFault); err != nil {
		t.Fatal(err)
	}
	if len(f.copyDevs) == 0 || f.copyDevs[0] != 1 {
		t.Fatalf("copies issued on devices %v, want 1 (GPU-bbbb in the agent's numbering)", f.copyDevs)
	}
	g.Release("m1")

	opened := f.opened
	src.Regions[0].Memory.DeviceUUID = "GPU-cccc"
	_, err := g.Copy("m2", src, dst, copies, transfer.NoFault)
	if err == nil || !strings.Contains(err.Error(), "GPU-cccc") || !strings.Contains(err.Error(), "not visible to this agent") {
		t.Fatalf("a GPU the agent cannot see: %v", err)
	}
	if f.opened != opened {
		t.Fatalf("%d mappings opened for a GPU the agent cannot see", f.opened-opened)
	}
}

// countingGPU counts the CUDA state a plane makes: driver loads, streams
// (one per device and context), kernel loads and pinned staging.
type countingGPU struct {
	fakeGPU
	streams, kernels, staging int
}

func (c *countingGPU) NewStream(int) (cuda.Stream, error) {
	c.streams++
	return cuda.Stream(c.streams), nil
}
func (c *countingGPU) PrepareKernels(int) error { c.kernels++; return nil }
func (c *countingGPU) HostAlloc(_ int, n uint64) ([]byte, error) {
	c.staging++
	return nil, nil
}

// Warm makes the CUDA state of the devices a layout's regions are on once,
// ahead of a migration, so that its rounds and checks find it made; a
// layout in host memory makes none.
func TestWarmMakesTheCUDAStateAheadOfAMigration(t *testing.T) {
	c := &countingGPU{fakeGPU: fakeGPU{live: map[cuda.DevicePtr]bool{}}}
	loads := 0
	g := NewPlane(zap.NewNop(), func() (cuda.Driver, error) { loads++; return c, nil })
	if err := g.Warm(hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryShm}}}}); err != nil {
		t.Fatal(err)
	}
	if loads != 0 {
		t.Fatalf("a layout in shared memory loaded the driver %d times", loads)
	}
	src, dst := gpuLayout(t, 1), gpuLayout(t, 2)
	two := src
	two.Regions = append(append([]hooks.Region(nil), src.Regions...), src.Regions...)
	if err := g.Warm(two); err != nil {
		t.Fatal(err)
	}
	if loads != 1 || c.streams != 1 || c.kernels != 1 || c.staging != 1 {
		t.Fatalf("warm: %d driver loads, %d streams, %d kernel loads, %d stagings; want one each", loads, c.streams, c.kernels, c.staging)
	}
	if _, err := g.Copy("m1", src, dst, []kvlayout.BlockCopy{{Src: 1, Dst: 5, NumSlots: 4}}, transfer.NoFault); err != nil {
		t.Fatal(err)
	}
	if err := g.PrepareTarget("m2", dst); err != nil {
		t.Fatal(err)
	}
	if loads != 1 || c.streams != 1 || c.kernels != 1 || c.staging != 1 {
		t.Fatalf("a round and a prepare after the warm-up made more: %d driver loads, %d streams, %d kernel loads, %d stagings", loads, c.streams, c.kernels, c.staging)
	}
}

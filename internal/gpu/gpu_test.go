package gpu

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// An H200 server as go-nvml's mock describes it: every GPU listed with
// its UUID, name, memory and PCI address; links read from NVLink state
// first, then the PCIe topology.
func TestDiscoverAnH200Server(t *testing.T) {
	srv := dgxh200.New()
	d0, d1, d2 := srv.Devices[0].(*server.Device), srv.Devices[1].(*server.Device), srv.Devices[2].(*server.Device)
	// The mock gives no PCI address; give GPUs 1 and 2 theirs.
	at := func(bus uint32) func() (nvml.PciInfo, nvml.Return) {
		return func() (nvml.PciInfo, nvml.Return) {
			return nvml.PciInfo{Bus: bus, PciDeviceId: 0x233310DE}, nvml.SUCCESS
		}
	}
	d1.GetPciInfoFunc, d2.GetPciInfoFunc = at(0x19), at(0x3b)
	inv := Discover(srv)
	defer inv.Close()
	if inv.Unavailable != "" || len(inv.Devices) != 8 {
		t.Fatalf("%q, %d devices", inv.Unavailable, len(inv.Devices))
	}
	g := inv.Devices[1]
	if g.Index != 1 || !strings.HasPrefix(g.UUID, "GPU-") || !strings.Contains(g.Name, "H200") || g.MemoryBytes < 140<<30 || g.PCIBusID == "" {
		t.Fatalf("%+v", g)
	}
	if inv.Devices[1].PCIBusID != "00000000:19:00.0" || inv.Devices[2].PCIBusID != "00000000:3b:00.0" {
		t.Fatalf("PCI addresses %q, %q", inv.Devices[1].PCIBusID, inv.Devices[2].PCIBusID)
	}
	if got := inv.Link(3, 3); got != "same GPU" {
		t.Fatalf("Link(3, 3) = %q", got)
	}
	// The mock knows no topology: unknown, not a crash.
	if got := inv.Link(0, 1); got != "" {
		t.Fatalf("Link with no topology = %q", got)
	}
	// GPU 0's link 2 ends at GPU 1; GPUs 0 and 2 meet across sockets.
	d0.GetNvLinkStateFunc = func(l int) (nvml.EnableState, nvml.Return) {
		if l == 2 {
			return nvml.FEATURE_ENABLED, nvml.SUCCESS
		}
		return nvml.FEATURE_DISABLED, nvml.SUCCESS
	}
	d0.GetNvLinkRemotePciInfoFunc = func(int) (nvml.PciInfo, nvml.Return) { return d1.GetPciInfo() }
	d0.GetTopologyCommonAncestorFunc = func(nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
		return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
	}
	if got := inv.Link(0, 1); got != "NVLink" {
		t.Fatalf("Link(0, 1) = %q, want NVLink", got)
	}
	if got := inv.Link(0, 2); got != "across CPU sockets" {
		t.Fatalf("Link(0, 2) = %q", got)
	}
	if got := inv.Link(0, 9); got != "" {
		t.Fatalf("Link to a GPU that is not there = %q", got)
	}
}

// No NVML is a reason, not an error.
func TestDiscoverWithoutNVML(t *testing.T) {
	lib := &mock.Interface{
		InitFunc:        func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND },
		ErrorStringFunc: func(nvml.Return) string { return "libnvidia-ml.so.1 not found" },
	}
	inv := Discover(lib)
	defer inv.Close()
	if len(inv.Devices) != 0 || inv.Unavailable != "NVML unavailable: libnvidia-ml.so.1 not found" || inv.Link(0, 1) != "" {
		t.Fatalf("%+v", inv)
	}
	// And this machine's own NVML, whatever it has: devices or a reason.
	real := Discover(nil)
	defer real.Close()
	if len(real.Devices) == 0 && real.Unavailable == "" {
		t.Fatal("no GPU and no reason")
	}
}

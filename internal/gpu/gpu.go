// Package gpu reads this node's NVIDIA GPUs through NVML (go-nvml, which
// dlopens libnvidia-ml.so.1 once, at Discover): what an agent reports to
// the Host about the GPUs beside it, and how two of them are linked. A
// node without NVML (no driver, no GPU) is a reason to report, never an
// error or a crash.
package gpu

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Device is one GPU as NVML sees it.
type Device struct {
	Index       int    `json:"index"`
	UUID        string `json:"uuid"`
	Name        string `json:"name"`
	MemoryBytes uint64 `json:"memory_bytes"`
	PCIBusID    string `json:"pci_bus_id"`
}

// Inventory is the node's GPUs. Unavailable says why there are none
// (NVML missing or failing); it is "" when NVML answered.
type Inventory struct {
	Devices     []Device
	Unavailable string

	lib     nvml.Interface
	handles []nvml.Device
}

// Discover reads the GPUs through lib (nil: the node's NVML). Close the
// inventory when done with Link.
func Discover(lib nvml.Interface) *Inventory {
	if lib == nil {
		lib = nvml.New()
	}
	inv := &Inventory{lib: lib}
	if ret := lib.Init(); ret != nvml.SUCCESS {
		inv.lib = nil
		inv.Unavailable = "NVML unavailable: " + lib.ErrorString(ret)
		return inv
	}
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		inv.Unavailable = "NVML could not count the GPUs: " + lib.ErrorString(ret)
		return inv
	}
	for i := 0; i < n; i++ {
		h, ret := lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			continue
		}
		d := Device{Index: i}
		d.UUID, _ = h.GetUUID()
		d.Name, _ = h.GetName()
		if m, ret := h.GetMemoryInfo(); ret == nvml.SUCCESS {
			d.MemoryBytes = m.Total
		}
		if p, ret := h.GetPciInfo(); ret == nvml.SUCCESS {
			d.PCIBusID = busID(p)
		}
		inv.Devices = append(inv.Devices, d)
		inv.handles = append(inv.handles, h)
	}
	if len(inv.Devices) == 0 {
		inv.Unavailable = "NVML sees no GPU"
	}
	return inv
}

// Close releases NVML.
func (inv *Inventory) Close() {
	if inv.lib != nil {
		inv.lib.Shutdown()
		inv.lib = nil
	}
}

// IndexOf is the NVML index of the GPU with this UUID, or -1.
func (inv *Inventory) IndexOf(uuid string) int {
	for _, d := range inv.Devices {
		if uuid != "" && d.UUID == uuid {
			return d.Index
		}
	}
	return -1
}

// Link says how GPUs a and b (NVML indices) reach each other: "same
// GPU", "NVLink", or the PCIe path NVML reports; "" when unknown.
func (inv *Inventory) Link(a, b int) string {
	if a == b {
		return "same GPU"
	}
	if inv.lib == nil || a < 0 || b < 0 || a >= len(inv.handles) || b >= len(inv.handles) {
		return ""
	}
	// NVLink: one of a's links is up and ends at b.
	for l := 0; l < nvml.NVLINK_MAX_LINKS; l++ {
		st, ret := safeNvLinkState(inv.handles[a], l)
		if ret != nvml.SUCCESS || st != nvml.FEATURE_ENABLED {
			continue
		}
		if p, ret := safeNvLinkRemote(inv.handles[a], l); ret == nvml.SUCCESS && busID(p) == inv.Devices[b].PCIBusID {
			return "NVLink"
		}
	}
	level, ret := safeCommonAncestor(inv.handles[a], inv.handles[b])
	if ret != nvml.SUCCESS {
		return ""
	}
	switch level {
	case nvml.TOPOLOGY_INTERNAL:
		return "same board"
	case nvml.TOPOLOGY_SINGLE:
		return "PCIe, one switch"
	case nvml.TOPOLOGY_MULTIPLE:
		return "PCIe, several switches"
	case nvml.TOPOLOGY_HOSTBRIDGE:
		return "PCIe host bridge"
	case nvml.TOPOLOGY_NODE:
		return "PCIe, across host bridges of one CPU"
	case nvml.TOPOLOGY_SYSTEM:
		return "across CPU sockets"
	}
	return ""
}

// busID is the PCI address NVML gives (its busId string), else one made
// of the domain, bus and device numbers.
func busID(p nvml.PciInfo) string {
	var b []byte
	for _, c := range p.BusId {
		if c == 0 {
			break
		}
		b = append(b, byte(c))
	}
	if len(b) > 0 {
		return string(b)
	}
	return fmt.Sprintf("%08x:%02x:%02x.0", p.Domain, p.Bus, p.Device)
}

// The NVML calls below are optional (older drivers, vGPUs and test
// doubles may lack them): a missing one reads as "not supported".
func safeNvLinkState(d nvml.Device, l int) (st nvml.EnableState, ret nvml.Return) {
	defer func() {
		if recover() != nil {
			ret = nvml.ERROR_NOT_SUPPORTED
		}
	}()
	return d.GetNvLinkState(l)
}

func safeNvLinkRemote(d nvml.Device, l int) (p nvml.PciInfo, ret nvml.Return) {
	defer func() {
		if recover() != nil {
			ret = nvml.ERROR_NOT_SUPPORTED
		}
	}()
	return d.GetNvLinkRemotePciInfo(l)
}

func safeCommonAncestor(a, b nvml.Device) (lv nvml.GpuTopologyLevel, ret nvml.Return) {
	defer func() {
		if recover() != nil {
			ret = nvml.ERROR_NOT_SUPPORTED
		}
	}()
	return a.GetTopologyCommonAncestor(b)
}

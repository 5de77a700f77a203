package rdma

import (
	"sort"
	"strings"
)

// Resources is what UCX found usable on this machine, from its context's
// description: its transports on each device ("tcp/eth0", "rc_mlx5/mlx5_0:1").
type Resources struct {
	Transports []string `json:"transports"`
	// RDMA are the devices with an RDMA transport (InfiniBand or RoCE
	// verbs: rc, ud, dc); empty where there is no RDMA NIC.
	RDMA []string `json:"rdma_devices,omitempty"`
	// CUDA reports a CUDA-enabled UCX (cuda_copy / cuda_ipc / gdr_copy):
	// it can read and write GPU memory itself.
	CUDA bool `json:"cuda,omitempty"`
}

// rdmaPrefixes are the verbs transports' name prefixes.
var rdmaPrefixes = []string{"rc_", "ud_", "dc_"}

// ParseResources reads the "resource N : md M dev D flags -- tl/dev"
// lines of ucp_context_print_info.
func ParseResources(info string) Resources {
	var r Resources
	rdma := map[string]bool{}
	for _, line := range strings.Split(info, "\n") {
		if !strings.Contains(line, "resource") {
			continue
		}
		_, res, ok := strings.Cut(line, "-- ")
		if !ok {
			continue
		}
		res = strings.TrimSpace(res)
		tl, dev, ok := strings.Cut(res, "/")
		if !ok {
			continue
		}
		r.Transports = append(r.Transports, res)
		for _, p := range rdmaPrefixes {
			if strings.HasPrefix(tl, p) {
				rdma[dev] = true
			}
		}
		if strings.HasPrefix(tl, "cuda_") || tl == "gdr_copy" {
			r.CUDA = true
		}
	}
	for d := range rdma {
		r.RDMA = append(r.RDMA, d)
	}
	sort.Strings(r.RDMA)
	return r
}

// Resources is this context's.
func (c *Context) Resources() Resources { return ParseResources(c.Info()) }

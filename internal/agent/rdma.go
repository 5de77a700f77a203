package agent

import (
	"fmt"
	"os"

	"go.uber.org/zap"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/rdma"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// openRDMA loads UCX for the rdma data plane. Where it is missing the
// agent runs without one (auto never picks it), unless rdma was asked
// for: then the agent does not start.
func (a *Agent) openRDMA() (func(), error) {
	p, err := rdma.Open()
	if err != nil {
		a.rdmaNote = err.Error()
		if a.cfg.TransferBackend == transfer.RDMA {
			return nil, fmt.Errorf("--transfer-backend rdma: %w", err)
		}
		a.log.Info("no rdma data plane", zap.String("reason", a.rdmaNote))
		return func() {}, nil
	}
	a.rdma = p
	res := p.Resources()
	a.log.Info("rdma data plane", zap.String("ucx", p.Version()), zap.Strings("rdma_devices", res.RDMA), zap.Strings("transports", res.Transports))
	return p.Close, nil
}

// dataOptions are the data server's options: the rdma carrier offered
// when UCX is loaded.
func (a *Agent) dataOptions() tcpshm.Options {
	o := tcpshm.Options{TLS: a.serverTLS}
	if a.rdma != nil {
		o.Receivers = map[string]tcpshm.NewReceiver{rdma.Mode: a.rdma.NewReceiver}
	}
	return o
}

// rdmaInfo is what this agent tells the Host and migrations' sources of
// its rdma data plane (nil: none).
func (a *Agent) rdmaInfo() *v1.RDMAInfo {
	if a.rdma == nil || a.dp.server == nil {
		return nil // no UCX, or no data plane at all (a routing-only engine)
	}
	host, _ := os.Hostname()
	res := a.rdma.Resources()
	return &v1.RDMAInfo{UcxVersion: a.rdma.Version(), Devices: res.RDMA, Transports: res.Transports, Cuda: res.CUDA, Hostname: host}
}

// rdmaPeers are the source's (this agent's) and the target's rdma planes
// as Pick weighs them.
func (a *Agent) rdmaPeers(target *v1.RDMAInfo) transfer.RDMAPeers {
	var p transfer.RDMAPeers
	if mine := a.rdmaInfo(); mine != nil {
		p.Source = &transfer.RDMAPlane{Devices: mine.GetDevices(), Hostname: mine.GetHostname()}
	}
	if target != nil {
		p.Target = &transfer.RDMAPlane{Devices: target.GetDevices(), Hostname: target.GetHostname()}
	}
	return p
}

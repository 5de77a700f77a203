package host

import (
	"context"
	"errors"

	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// registryService is the Registry gRPC service. Its errors become gRPC
// statuses at the edge, once (grpcauth's server interceptor).
type registryService struct {
	v1.UnimplementedRegistryServer
	h *Host
}

func (s *registryService) Register(_ context.Context, req *v1.RegisterRequest) (*v1.RegisterResponse, error) {
	reg := registrationFromProto(req)
	inst, err := s.h.reg.Register(reg)
	if err != nil {
		result := "invalid"
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			result = "conflict"
		}
		s.h.m.registrations.WithLabelValues(result).Inc()
		return nil, err
	}
	s.h.m.registrations.WithLabelValues("ok").Inc()
	s.h.logInstance("registered", inst)
	resp := &v1.RegisterResponse{VllmHiId: inst.ID, HeartbeatIntervalMs: s.h.reg.HeartbeatInterval().Milliseconds()}
	if s.h.leads() {
		// What the agent keeps (and tells a Host that lost its state)
		// comes from the Host that decides.
		resp.Role, resp.Lifecycle = roleToProto(inst.Role), string(inst.Lifecycle())
	}
	return resp, nil
}

func roleToProto(r registry.Role) v1.Role {
	switch r {
	case registry.RoleActive:
		return v1.Role_ROLE_ACTIVE
	case registry.RoleStandby:
		return v1.Role_ROLE_STANDBY
	}
	return v1.Role_ROLE_UNSPECIFIED
}

func roleFromProto(r v1.Role) registry.Role {
	switch r {
	case v1.Role_ROLE_ACTIVE:
		return registry.RoleActive
	case v1.Role_ROLE_STANDBY:
		return registry.RoleStandby
	}
	return ""
}

func (s *registryService) Heartbeat(_ context.Context, req *v1.HeartbeatRequest) (*v1.HeartbeatResponse, error) {
	st := req.GetStats()
	err := s.h.reg.Heartbeat(req.GetVllmHiId(), req.GetSession(), registry.Stats{
		Healthy: st.GetHealthy(), Running: int(st.GetNumRunning()), Waiting: int(st.GetNumWaiting()),
		FreeBlocks: int(st.GetFreeBlocks()), TotalBlocks: int(st.GetTotalBlocks()), Sleeping: st.GetSleeping(),
	})
	if err != nil {
		s.h.m.heartbeats.WithLabelValues("unknown").Inc()
		return nil, err
	}
	s.h.m.heartbeats.WithLabelValues("ok").Inc()
	inst, err := s.h.reg.Get(req.GetVllmHiId())
	if err != nil || !s.h.leads() {
		return &v1.HeartbeatResponse{}, nil
	}
	return &v1.HeartbeatResponse{Role: roleToProto(inst.Role), Lifecycle: string(inst.Lifecycle())}, nil
}

func (s *registryService) Deregister(_ context.Context, req *v1.DeregisterRequest) (*v1.DeregisterResponse, error) {
	inst, _ := s.h.reg.Get(req.GetVllmHiId())
	if err := s.h.reg.Deregister(req.GetVllmHiId(), req.GetSession()); err != nil {
		return nil, err
	}
	s.h.logInstance("deregistered", inst)
	return &v1.DeregisterResponse{}, nil
}

// Drain drains the calling agent's own instance (its session proves it),
// or reports the drain under way.
func (s *registryService) Drain(_ context.Context, req *v1.DrainSelfRequest) (*v1.DrainSelfResponse, error) {
	if err := s.h.reg.Owned(req.GetVllmHiId(), req.GetSession()); err != nil {
		return nil, err
	}
	if !s.h.leads() {
		return nil, errdefs.New(errdefs.ErrUnavailable, "this Host does not lead the shared store: ask the one that does")
	}
	st, err := s.h.drainer.ForStop(req.GetVllmHiId())
	if err != nil {
		return nil, err
	}
	return &v1.DrainSelfResponse{DrainId: st.ID, State: st.State, Moved: int32(st.Moved), Remaining: int32(st.Remaining), Error: st.Error}, nil
}

func registrationFromProto(req *v1.RegisterRequest) registry.Registration {
	e := req.GetEngine()
	g := e.GetGeometry()
	typ := ""
	switch req.GetType() {
	case v1.InstanceType_INSTANCE_TYPE_A:
		typ = "A"
	case v1.InstanceType_INSTANCE_TYPE_B:
		typ = "B"
	}
	return registry.Registration{
		ID: req.GetVllmHiId(), Type: typ, Session: req.GetSession(), Hostname: req.GetHostname(),
		AgentAddress: req.GetAgentAddress(), DataAddress: req.GetDataAddress(), TransferBackend: req.GetTransferBackend(),
		TLS: req.GetTls(), Role: roleFromProto(req.GetRole()), Retired: req.GetRetired(),
		GPUs: gpusFromProto(req.GetGpus()), GPUNote: req.GetGpusNote(), RDMA: rdmaFromProto(req.GetRdma()), RDMANote: req.GetRdmaNote(),
		Engine: registry.Engine{
			URL: e.GetEngineUrl(), ServedModels: e.GetServedModelNames(), Model: e.GetModel(),
			TP: int(e.GetTp()), PP: int(e.GetPp()), MaxModelLen: int(e.GetMaxModelLen()),
			Migratable: e.GetMigratable(), Kind: e.GetEngineKind(), Version: e.GetEngineVersion(),
			HooksAuthenticated: e.GetHooksAuthenticated(),
			Geometry: registry.Geometry{
				Layers: int(g.GetNumLayers()), KVHeads: int(g.GetNumKvHeads()), HeadDim: int(g.GetHeadDim()),
				DTypeBytes: int(g.GetDtypeBytes()), DType: g.GetDtype(), BlockSize: int(g.GetBlockSize()), NumBlocks: int(g.GetNumBlocks()),
			},
		},
	}
}

func rdmaFromProto(r *v1.RDMAInfo) *registry.RDMA {
	if r == nil {
		return nil
	}
	return &registry.RDMA{UCXVersion: r.GetUcxVersion(), Devices: r.GetDevices(), Transports: r.GetTransports(), CUDA: r.GetCuda()}
}

func gpusFromProto(gs []*v1.GPU) []registry.GPU {
	var out []registry.GPU
	for _, g := range gs {
		out = append(out, registry.GPU{Index: int(g.GetIndex()), UUID: g.GetUuid(), Name: g.GetName(),
			MemoryBytes: g.GetMemoryBytes(), PCIBusID: g.GetPciBusId()})
	}
	return out
}

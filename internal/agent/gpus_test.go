package agent

import (
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"

	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/gpu"
)

// The registration carries the node's GPUs, or why there are none.
func TestRegistrationReportsTheGPUs(t *testing.T) {
	a := &Agent{cfg: Config{ID: "a", Type: "A"}, gpus: gpu.Discover(dgxh200.New())}
	req := a.registerRequest(engine.Info{URL: "http://e"}, "127.0.0.1:1", "")
	if len(req.GetGpus()) != 8 || req.GetGpusNote() != "" || !strings.Contains(req.GetGpus()[7].GetName(), "H200") ||
		req.GetGpus()[7].GetIndex() != 7 || !strings.HasPrefix(req.GetGpus()[7].GetUuid(), "GPU-") {
		t.Fatalf("%v %q", req.GetGpus(), req.GetGpusNote())
	}
	none := &Agent{cfg: Config{ID: "b", Type: "B"}, gpus: gpu.Discover(&mock.Interface{
		InitFunc:        func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND },
		ErrorStringFunc: func(nvml.Return) string { return "not found" },
	})}
	req = none.registerRequest(engine.Info{URL: "http://e"}, "127.0.0.1:1", "")
	if len(req.GetGpus()) != 0 || req.GetGpusNote() != "NVML unavailable: not found" {
		t.Fatalf("%v %q", req.GetGpus(), req.GetGpusNote())
	}
}

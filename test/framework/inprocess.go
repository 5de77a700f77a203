package framework

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// simConfig is every in-process engine's: the e2e sims' flags
// (--num-gpu-blocks 4096 --max-model-len 1024 --step-fixed 6ms).
func simConfig(t *testing.T) sim.Config {
	c := sim.DefaultConfig()
	c.NumBlocks, c.MaxModelLen = 4096, 1024
	c.Step = sim.StepModel{Fixed: 6 * time.Millisecond}
	c.ShmDir = t.TempDir()
	return c
}

// InProcess starts the Host, the sims and their agents in this process
// (internal/stack), with a reference sim beside them.
func InProcess(t *testing.T, o Options) Cluster {
	t.Helper()
	a := simConfig(t)
	ref := a
	b := a
	if o.BBlocks > 0 {
		b.NumBlocks = o.BBlocks
	}
	if o.SourceStep > 0 {
		a.Step.Fixed = o.SourceStep
	}
	a.TP, a.PP = o.A.Sizes()
	b.TP, b.PP = o.B.Sizes()
	st, err := stack.Start(stack.Options{Model: Model, SimA: a, SimB: b, BActive: o.BActive, TuneHost: func(c *host.Config) {
		c.Migration.AllowFaultInjection = true
		// The binaries' heartbeat (test/e2e): at 200 ms, three missed
		// beats were 0.6 s, which a starved machine under -race can miss
		// and then refuse a migration as "not healthy".
		c.HeartbeatInterval = 500 * time.Millisecond
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(st.Stop)
	ref.Model, ref.ServedModelNames, ref.ShmPrefix = Model, []string{Model}, fmt.Sprintf("vhi-ref-%d", os.Getpid())
	r, err := sim.Start(ref, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Stop)
	return &inProcess{st: st, ref: r.URL}
}

type inProcess struct {
	st  *stack.Stack
	ref string
}

var _ Cluster = (*inProcess)(nil)

func (c *inProcess) Host() *hostapi.Client { return c.st.Client() }
func (c *inProcess) HostURL() string       { return c.st.HostURL }
func (c *inProcess) A() string             { return c.st.AID }
func (c *inProcess) B() string             { return c.st.BID }

func (c *inProcess) Engine(id string) hooks.Engine {
	if id == c.st.BID {
		return c.st.B
	}
	return c.st.A
}

func (c *inProcess) HoldTail(id string, tokens int) error {
	e := c.st.A
	if id == c.st.BID {
		e = c.st.B
	}
	e.HoldTail(tokens)
	return nil
}

func (c *inProcess) Reference(reqs []loadgen.Request) []loadgen.Stream {
	return loadgen.Run(context.Background(), loadgen.Config{BaseURL: c.ref, Model: Model}, reqs)
}

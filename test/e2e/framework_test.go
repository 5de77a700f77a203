package e2e

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/api/httpjson"
	"github.com/vllm-hi/vllm-hi/internal/engine"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/test/framework"
)

// The migration cases of test/framework against the binaries: the same
// tests its in-process runner runs (with VHI_E2E_SIM_DEVICES, on GPUs).
func TestMigrationCases(t *testing.T) {
	framework.Run(t, func(t *testing.T, o framework.Options) framework.Cluster {
		blocks := o.BBlocks
		if blocks == 0 {
			blocks = 4096
		}
		aArgs := shapeArgs(o.A)
		if o.SourceStep > 0 {
			aArgs = append(aArgs, "--step-fixed", o.SourceStep.String())
		}
		d := deployWith(t, deployOptions{bBlocks: blocks, aArgs: aArgs, bArgs: shapeArgs(o.B), bActive: o.BActive,
			aRanks: ranks(o.A), bRanks: ranks(o.B)})
		d.client = hostClient(t, d.hostURL, d.tk.admin)
		return d
	}, framework.Cases())
}

// ranks is shape s's TP × PP.
func ranks(s framework.Shape) int {
	tp, pp := s.Sizes()
	return tp * pp
}

// shapeArgs are a sim's flags for shape s.
func shapeArgs(s framework.Shape) []string {
	tp, pp := s.Sizes()
	return []string{"--tp", fmt.Sprint(tp), "--pp", fmt.Sprint(pp)} // the contract's names
}

var _ framework.Cluster = (*deployment)(nil)

func (d *deployment) Host() *hostapi.Client { return d.client }
func (d *deployment) HostURL() string       { return d.hostURL }
func (d *deployment) A() string             { return "A" }
func (d *deployment) B() string             { return "B" }

func (d *deployment) Engine(id string) hooks.Engine {
	url := d.aURL
	if id == "B" {
		url = d.bURL
	}
	e, err := engine.NewClient(url, engine.Options{Token: d.tk.agent})
	if err != nil {
		panic(err) // the URLs are the deployment's own
	}
	return e
}

func (d *deployment) HoldTail(id string, tokens int) error {
	url := d.aURL
	if id == "B" {
		url = d.bURL
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	status, b, err := httpjson.Do(ctx, http.DefaultClient, http.MethodPost, url+"/vhi_sim/hold_tail", d.tk.agent,
		[]byte(fmt.Sprintf(`{"tokens":%d}`, tokens)), 1<<20)
	if err != nil {
		return err
	}
	if status != http.StatusOK {
		return fmt.Errorf("POST /vhi_sim/hold_tail: %d: %s", status, b)
	}
	return nil
}

func (d *deployment) Reference(reqs []loadgen.Request) []loadgen.Stream {
	return loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.refURL, Model: framework.Model}, reqs)
}

package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
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
	req, err := http.NewRequest(http.MethodPost, url+"/vhi_sim/hold_tail", strings.NewReader(fmt.Sprintf(`{"tokens":%d}`, tokens)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+d.tk.agent)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("POST /vhi_sim/hold_tail: %s: %s", resp.Status, b)
	}
	return nil
}

func (d *deployment) Reference(reqs []loadgen.Request) []loadgen.Stream {
	return loadgen.Run(context.Background(), loadgen.Config{BaseURL: d.refURL, Model: framework.Model}, reqs)
}

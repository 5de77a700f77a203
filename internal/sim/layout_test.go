package sim

import (
	"fmt"
	"reflect"
	"sync"
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
)

// A request's tokens follow its KV's values, not where a layout or a
// device keeps them: the same requests, side by side, give the same tokens
// head-major and slot-major, in files and (where this machine has a GPU)
// in GPU memory, at TP1 and TP2 — so each layout's writes and reads put
// every head's slot where the other reads it back.
func TestLayoutsAndDevicesGiveTheSameTokens(t *testing.T) {
	type shape struct {
		layout, device string
		tp             int
	}
	shapes := []shape{{"HND", "cpu", 1}, {"NHD", "cpu", 1}, {"NHD", "cpu", 2}}
	if drv, err := cuda.Load(); err == nil {
		n, _ := drv.DeviceCount()
		drv.Close()
		if n > 0 {
			shapes = append(shapes, shape{"HND", "cuda:0", 1}, shape{"NHD", "cuda:0", 1}, shape{"NHD", "cuda:0", 2})
		}
	} else {
		t.Log("no GPU here: the layouts in files only")
	}
	var reference [][]int
	for _, s := range shapes {
		name := fmt.Sprintf("%s-%s-tp%d", s.layout, s.device, s.tp)
		c := testConfig(t)
		// Whole 16-byte head slots, as the GPU path needs.
		c.Profile, c.KVScale = "qwen3-8b", 8
		c.KVLayout, c.Device, c.TP = s.layout, s.device, s.tp
		e := startEngine(t, c)
		got := make([][]int, 8)
		var wg sync.WaitGroup
		for i := range got {
			p := greedy(30 + 3*i)
			if i%2 == 1 {
				p.Temperature, p.Seed = 0.8, int64(40+i)
			}
			id := fmt.Sprintf("%s-%d", name, i)
			if err := e.Submit(NewRequest{ID: id, Prompt: prompt(9+11*i, i), Params: p, SeedSet: true}); err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() { defer wg.Done(); got[i] = waitFinished(t, e, id).Tokens }()
		}
		wg.Wait()
		if reference == nil {
			reference = got
			continue
		}
		for i := range got {
			if !reflect.DeepEqual(got[i], reference[i]) {
				t.Errorf("%s: request %d differs from %s-%s-tp%d:\n got %v\nwant %v", name, i, shapes[0].layout, shapes[0].device, shapes[0].tp, got[i], reference[i])
			}
		}
	}
}

package sim

import (
	"context"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/tokenizer"
)

func greedy(maxTokens int) hooks.SamplingParams {
	return hooks.SamplingParams{Temperature: 0, MaxTokens: maxTokens, IgnoreEOS: true, Seed: 7}
}

// The same requests give the same tokens alone, all at once, in another
// order, under preemption, and on another engine instance.
func TestBatchInvariance(t *testing.T) {
	type job struct {
		prompt []int
		params hooks.SamplingParams
	}
	var jobs []job
	for i := 0; i < 12; i++ {
		p := greedy(20 + i*5)
		if i%3 == 1 {
			p.Temperature, p.Seed = 0.9, int64(100+i)
		}
		jobs = append(jobs, job{prompt(5+i*7, i), p})
	}
	reference := make([][]int, len(jobs))
	solo := startEngine(t, testConfig(t))
	for i, j := range jobs {
		reference[i] = run(t, solo, fmt.Sprintf("solo-%d", i), j.prompt, j.params).Tokens
	}

	check := func(name string, c Config, reverse bool) {
		t.Run(name, func(t *testing.T) {
			e := startEngine(t, c)
			var wg sync.WaitGroup
			got := make([][]int, len(jobs))
			for k := range jobs {
				i := k
				if reverse {
					i = len(jobs) - 1 - k
				}
				id := fmt.Sprintf("%s-%d", name, i)
				if err := e.Submit(NewRequest{ID: id, Prompt: jobs[i].prompt, Params: jobs[i].params, SeedSet: true}); err != nil {
					t.Fatal(err)
				}
				wg.Add(1)
				go func() { defer wg.Done(); got[i] = waitFinished(t, e, id).Tokens }()
			}
			wg.Wait()
			for i := range jobs {
				if !reflect.DeepEqual(got[i], reference[i]) {
					t.Errorf("request %d differs from its solo run:\n got %v\nwant %v", i, got[i], reference[i])
				}
			}
			if name == "preempting" && e.Preemptions() == 0 {
				t.Errorf("expected preemptions with %d blocks", c.NumBlocks)
			}
			st, _ := e.Stats(context.Background())
			if st.FreeBlocks != st.TotalBlocks {
				t.Errorf("leaked blocks: %d free of %d", st.FreeBlocks, st.TotalBlocks)
			}
		})
	}
	check("concurrent", testConfig(t), false)
	check("reversed", testConfig(t), true)
	small := testConfig(t)
	small.NumBlocks = 140 // the longest request needs ~36 blocks; all twelve need ~300
	small.MaxNumBatchedTokens = 32
	check("preempting", small, false)
	tp := testConfig(t)
	tp.TP, tp.PP = 2, 2
	check("tp2pp2", tp, true)
	// vLLM's own layout: a slot's heads side by side, each TP rank's
	// slice of them in its own region.
	nhd := testConfig(t)
	nhd.KVLayout = "NHD"
	check("nhd", nhd, false)
	nhd.TP, nhd.PP = 2, 2
	check("nhd-tp2pp2", nhd, true)
}

// Flipping one byte of a running request's KV in the shared-memory file
// changes its continuation; flipping a byte of a free block does not.
func TestTamperedKVDiverges(t *testing.T) {
	c := testConfig(t)
	c.Step.Fixed = 3 * time.Millisecond
	p := prompt(40, 1)
	ref := run(t, startEngine(t, c), "ref", p, greedy(120)).Tokens

	tamper := func(t *testing.T, pickBlock func(owned []int, free int) int) ([]int, int) {
		c2 := c
		c2.ShmDir = t.TempDir()
		e := startEngine(t, c2)
		if err := e.Submit(NewRequest{ID: "victim", Prompt: p, Params: greedy(120), SeedSet: true}); err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		o, err := e.Watch(ctx, "victim", 30) // wait for 30+ tokens
		if err != nil {
			t.Fatal(err)
		}
		_ = o
		lay, _ := e.Layout(ctx)
		reqs, _ := e.Requests(ctx)
		var owned []int
		flippedAt := 0
		for _, r := range reqs.Requests {
			if r.RequestID == "victim" {
				owned, flippedAt = r.BlockIDs, r.NumOutputTokens
			}
		}
		block := pickBlock(owned, c2.NumBlocks-1)
		reg := lay.Regions[0]
		rl := kvlayout.NewRegionLayout(lay.Geometry, kvlayout.Shard{TPSize: 1, PPSize: 1})
		off := rl.Offset(reg.NumLayers-1, 1, block, 0, 1) + 1 // V of the last layer, slot 1
		f, err := os.OpenFile(reg.Memory.Path, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		var b [1]byte
		_, _ = f.ReadAt(b[:], off)
		b[0] ^= 0x01
		if _, err := f.WriteAt(b[:], off); err != nil {
			t.Fatal(err)
		}
		f.Close()
		return waitFinished(t, e, "victim").Tokens, flippedAt
	}

	t.Run("owned block", func(t *testing.T) {
		got, at := tamper(t, func(owned []int, _ int) int { return owned[0] })
		if reflect.DeepEqual(got, ref) {
			t.Fatalf("a flipped KV byte did not change the output")
		}
		if !reflect.DeepEqual(got[:at], ref[:at]) {
			t.Fatalf("tokens before the flip changed")
		}
	})
	t.Run("free block", func(t *testing.T) {
		got, _ := tamper(t, func(_ []int, last int) int { return last })
		if !reflect.DeepEqual(got, ref) {
			t.Fatalf("a flipped byte in a free block changed the output")
		}
	})
}

func TestStopConditions(t *testing.T) {
	e := startEngine(t, testConfig(t))
	tok := e.Tokenizer()

	t.Run("length", func(t *testing.T) {
		o := run(t, e, "len", prompt(8, 1), greedy(17))
		if o.Reason != "length" || len(o.Tokens) != 17 {
			t.Fatalf("got %s with %d tokens", o.Reason, len(o.Tokens))
		}
	})
	t.Run("max_model_len", func(t *testing.T) {
		c := testConfig(t)
		c.MaxModelLen = 40
		e2 := startEngine(t, c)
		if err := e2.Submit(NewRequest{ID: "x", Prompt: prompt(30, 1), Params: greedy(11), SeedSet: true}); err == nil {
			t.Fatalf("prompt + max_tokens beyond max_model_len was accepted")
		}
		o := run(t, e2, "y", prompt(30, 1), greedy(10))
		if o.Reason != "length" || len(o.Tokens) != 10 {
			t.Fatalf("got %s with %d tokens", o.Reason, len(o.Tokens))
		}
	})
	t.Run("stop string", func(t *testing.T) {
		full := run(t, e, "full", prompt(8, 2), greedy(40))
		// Stop at the text of the 10th token: output ends before it.
		stop := tok.Piece(full.Tokens[9])
		p := greedy(40)
		p.Stop = []string{stop}
		o := run(t, e, "stop", prompt(8, 2), p)
		if o.Reason != "stop" || o.StopReason != stop {
			t.Fatalf("finish %s/%v, want stop/%q", o.Reason, o.StopReason, stop)
		}
		want := tok.Decode(full.Tokens)
		want = want[:len(tok.Decode(full.Tokens[:9]))]
		if idx := indexOf(tok.Decode(full.Tokens), stop); idx < len(want) {
			want = want[:idx]
		}
		if o.Text != want {
			t.Fatalf("text %q, want %q", o.Text, want)
		}
	})
	t.Run("stop token id", func(t *testing.T) {
		full := run(t, e, "full2", prompt(8, 3), greedy(40))
		p := greedy(40)
		p.StopTokenIDs = []int{full.Tokens[5]}
		o := run(t, e, "stoptok", prompt(8, 3), p)
		if o.Reason != "stop" || o.StopReason != full.Tokens[5] {
			t.Fatalf("finish %s/%v", o.Reason, o.StopReason)
		}
		if len(o.Tokens) > 6 {
			t.Fatalf("ran past the stop token: %d tokens", len(o.Tokens))
		}
	})
	t.Run("eos", func(t *testing.T) {
		c := testConfig(t)
		c.EOSOneIn = 4
		e2 := startEngine(t, c)
		p := greedy(200)
		p.IgnoreEOS = false
		o := run(t, e2, "eos", prompt(8, 4), p)
		if o.Reason != "stop" || o.Tokens[len(o.Tokens)-1] != tokenizer.EOS || o.StopReason != nil {
			t.Fatalf("finish %s/%v after %d tokens", o.Reason, o.StopReason, len(o.Tokens))
		}
	})
}

func indexOf(s, sub string) int {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return i
		}
	}
	return len(s)
}

// A client that goes away aborts its request and frees its blocks.
func TestClientAbortFreesBlocks(t *testing.T) {
	e := startEngine(t, testConfig(t))
	if err := e.Submit(NewRequest{ID: "gone", Prompt: prompt(20, 1), Params: greedy(400), SeedSet: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Watch(context.Background(), "gone", 5); err != nil {
		t.Fatal(err)
	}
	e.AbortClient("gone")
	o := waitFinished(t, e, "gone")
	if o.Reason != "abort" {
		t.Fatalf("reason %s", o.Reason)
	}
	st, _ := e.Stats(context.Background())
	if st.FreeBlocks != st.TotalBlocks || st.NumRunning != 0 {
		t.Fatalf("after abort: %+v", st)
	}
}

func TestConfigValidation(t *testing.T) {
	for name, mod := range map[string]func(*Config){
		"unknown profile":  func(c *Config) { c.Profile = "gpt-9" },
		"bad scale":        func(c *Config) { c.KVScale = 3 },
		"tp not dividing":  func(c *Config) { c.TP = 3 },
		"unknown layout":   func(c *Config) { c.KVLayout = "HDN" },
		"NHD, odd slots":   func(c *Config) { c.KVLayout, c.Profile, c.KVScale = "NHD", "qwen3-8b", 64 },
		"too few blocks":   func(c *Config) { c.NumBlocks = 10 },
		"zero seqs":        func(c *Config) { c.MaxNumSeqs = 0 },
		"budget < seqs":    func(c *Config) { c.MaxNumBatchedTokens = 1 },
		"missing shm dir":  func(c *Config) { c.ShmDir = "/nonexistent/dir" },
		"empty model name": func(c *Config) { c.Model = "" },
	} {
		t.Run(name, func(t *testing.T) {
			c := testConfig(t)
			mod(&c)
			if e, err := NewEngine(c, nil); err == nil {
				e.Close()
				t.Fatalf("accepted")
			}
		})
	}
}

// --device names one GPU for every rank or one per rank; anything else is
// refused before a driver is loaded (so the message is the same with or
// without a GPU).
func TestDeviceListIsOneOrOnePerRank(t *testing.T) {
	for _, tc := range []struct {
		device string
		tp, pp int
		want   string
	}{
		{"cuda:0,cuda:1,cuda:2", 2, 1, "lists 3 GPUs for 2 ranks"},
		{"cuda:0,cuda:1", 2, 2, "lists 2 GPUs for 4 ranks"},
		{"cuda:0,cpu", 2, 1, `"cpu": want cpu, cuda, cuda:N`},
		{"cuda:-1", 1, 1, "want cpu, cuda, cuda:N"},
		{"gpu0", 1, 1, "want cpu, cuda, cuda:N"},
	} {
		c := testConfig(t)
		c.Device, c.TP, c.PP = tc.device, tc.tp, tc.pp
		e, err := NewEngine(c, nil)
		if err == nil {
			e.Close()
			t.Fatalf("--device %s at TP %d × PP %d: accepted", tc.device, tc.tp, tc.pp)
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("--device %s at TP %d × PP %d: %v, want it to say %q", tc.device, tc.tp, tc.pp, err, tc.want)
		}
	}
	for _, tc := range []struct {
		device string
		tp, pp int
		want   []int
	}{
		{"cuda", 2, 1, []int{0}},
		{"cuda:1", 2, 2, []int{1}},
		{"cuda:0, cuda:1", 2, 1, []int{0, 1}},
		{"cuda:1,cuda:0,cuda:1,cuda:0", 2, 2, []int{1, 0, 1, 0}},
	} {
		c := testConfig(t)
		c.Device, c.TP, c.PP = tc.device, tc.tp, tc.pp
		if _, _, err := c.geometry(); err != nil {
			t.Fatalf("--device %s at TP %d × PP %d: %v", tc.device, tc.tp, tc.pp, err)
		}
		if _, got, _ := c.devices(); !slices.Equal(got, tc.want) {
			t.Errorf("--device %s: GPUs %v, want %v", tc.device, got, tc.want)
		}
	}
}

// Every earlier block is read within a few n steps wherever the sequence
// is, however long it grows.
func TestSampledBlockCoversEveryBlock(t *testing.T) {
	const bs = 16
	for _, start := range []int{17, 100, 1000, 8000} {
		n := (start - 1) / bs
		seen := make([]bool, n)
		left := n
		steps := 0
		for pos := start; left > 0; pos++ {
			steps++
			if steps > 4*n+16 {
				t.Fatalf("from position %d: %d of %d blocks unread after %d steps", start, left, n, steps)
			}
			if b := sampledBlock(pos, n); !seen[b] {
				seen[b] = true
				left--
			}
		}
	}
}

package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/pflag"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// opsBench is what the operations benchmarks (vhi bench drain, failover,
// rebalance) share: a load of sims, two active instances of one model
// behind a Host in this process, and an unmigrated reference to judge
// every stream by.
type opsBench struct {
	streams, maxTokens, promptWords int
	delay                           time.Duration
	geo                             simGeometryFlags
	log                             *zap.Logger
	// actives: the active sims start brings up (0: two, A and B).
	actives int
	// pacedTokens: vhi bench failover's paced mode's recompute per step.
	pacedTokens int
	// warmTokens: vhi bench failover's warm mode's warm standby threshold.
	warmTokens   int
	warmInterval time.Duration
}

func (o *opsBench) register(f *pflag.FlagSet, streams, tokens int, delay time.Duration) {
	f.IntVar(&o.streams, "streams", streams, "concurrent streams")
	f.IntVar(&o.maxTokens, "max-tokens", tokens, "tokens per stream")
	f.IntVar(&o.promptWords, "prompt-words", 200, "prompt length scale")
	f.DurationVar(&o.delay, "delay", delay, "load start → the operation")
	o.geo.register(f)
}

func (o opsBench) simConfig() sim.Config {
	c := sim.DefaultConfig()
	o.geo.apply(&c)
	return c
}

// requests is the load: the migration benchmark's (every other stream
// samples with a seed, so the sims' streams are exact either way).
func (o opsBench) requests() []loadgen.Request {
	return scenario{Streams: o.streams, MaxTokens: o.maxTokens, PromptWords: o.promptWords}.requests()
}

// reference runs reqs on a lone sim: what every stream must equal.
func (o opsBench) reference(ctx context.Context, reqs []loadgen.Request) ([]loadgen.Stream, error) {
	ref, err := scenario{Sim: o.simConfig(), DeviceA: "cpu", Log: o.log}.reference(ctx, reqs)
	if err != nil {
		return nil, fmt.Errorf("reference run: %w", err)
	}
	for i, s := range ref {
		if s.Err != nil {
			return nil, fmt.Errorf("reference run, stream %d: %w", i, s.Err)
		}
	}
	return ref, nil
}

// start brings up a Host with sims A and B, both active (and more
// active ones beside them, to o.actives).
func (o opsBench) start(tune func(*host.Config)) (*stack.Stack, error) {
	c := o.simConfig()
	return stack.Start(stack.Options{Model: "demo-model", SimA: c, SimB: c, Log: o.log, BActive: true, MoreActives: max(0, o.actives-2), TuneHost: tune})
}

// loadOnA streams reqs through the Host with every one of them on A — B
// takes no new requests until A runs or queues them all, then takes its
// share again: the skew a drain or a crash of a loaded instance meets.
func loadOnA(ctx context.Context, st *stack.Stack, reqs []loadgen.Request) (<-chan []loadgen.Stream, time.Time, error) {
	if _, err := st.Host.Registry().SetState(st.BID, registry.StateDraining, registry.StateActive); err != nil {
		return nil, time.Time{}, err
	}
	done, t0 := loadThrough(ctx, st, reqs)
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := st.A.Stats(ctx)
		if err != nil {
			return nil, t0, err
		}
		if s.NumRunning+s.NumWaiting >= len(reqs) {
			break
		}
		if time.Now().After(deadline) {
			return nil, t0, fmt.Errorf("after 30 s engine A holds %d of the %d requests", s.NumRunning+s.NumWaiting, len(reqs))
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, err := st.Client().Undrain(ctx, st.BID); err != nil {
		return nil, t0, err
	}
	return done, t0, nil
}

// loadThrough streams reqs through the Host in the background.
func loadThrough(ctx context.Context, st *stack.Stack, reqs []loadgen.Request) (<-chan []loadgen.Stream, time.Time) {
	done := make(chan []loadgen.Stream, 1)
	t0 := time.Now()
	go func() { done <- loadgen.Run(ctx, loadgen.Config{BaseURL: st.HostURL, Model: "demo-model"}, reqs) }()
	return done, t0
}

// wait sleeps d, or less if ctx ends.
func wait(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// streamCheck counts the streams that failed (a client-visible error)
// and those that ended without one but differ from their reference.
type streamCheck struct {
	Failed, Inexact int
	First           string // the first problem, said
}

func checkStreams(got, ref []loadgen.Stream) streamCheck {
	var c streamCheck
	for i, s := range got {
		msg := ""
		switch {
		case s.Err != nil:
			c.Failed++
			msg = fmt.Sprintf("stream %d failed: %v", i, s.Err)
		case s.Text != ref[i].Text || s.Done != 1:
			c.Inexact++
			msg = fmt.Sprintf("stream %d differs from its reference (%d [DONE])", i, s.Done)
		}
		if msg != "" && c.First == "" {
			c.First = msg
		}
	}
	return c
}

func (c streamCheck) String() string {
	if c.Failed == 0 && c.Inexact == 0 {
		return "0 failed, 0 inexact"
	}
	return fmt.Sprintf("%d FAILED, %d INEXACT (%s)", c.Failed, c.Inexact, c.First)
}

func (c streamCheck) err(what string) error {
	if c.Failed == 0 && c.Inexact == 0 {
		return nil
	}
	return fmt.Errorf("%s: %s", what, c)
}

// maxGapBetween is the longest inter-token gap of any stream that ended
// within [from, to].
func maxGapBetween(streams []loadgen.Stream, from, to time.Time) time.Duration {
	var m time.Duration
	for _, s := range streams {
		for j := 1; j < len(s.Arrivals); j++ {
			if a := s.Arrivals[j]; a.After(from) && a.Before(to) {
				m = max(m, a.Sub(s.Arrivals[j-1]))
			}
		}
	}
	return m
}

// lastArrival is when the last token of any stream arrived.
func lastArrival(streams []loadgen.Stream) time.Time {
	var t time.Time
	for _, s := range streams {
		if n := len(s.Arrivals); n > 0 && s.Arrivals[n-1].After(t) {
			t = s.Arrivals[n-1]
		}
	}
	return t
}

func msText(d time.Duration) string { return fmt.Sprintf("%.1f ms", ms(d)) }

func header(out io.Writer, name string, o opsBench, extra string) {
	c := o.simConfig()
	fmt.Fprintf(out, "vhi bench %s: %d streams × %d tokens, sim %s / kv-scale %d, %d blocks, %d seats per engine%s\n",
		name, o.streams, o.maxTokens, c.Profile, c.KVScale, c.NumBlocks, c.MaxNumSeqs, extra)
}

package failover

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// A dead engine's streams break together, and each reaches Recover on
// its own goroutine within a few milliseconds. Placed one at a time from
// the last heartbeat's free KV, every one of them would go to the one
// survivor that had the most free blocks, which then prefills them all
// while the others idle. Gathered for GatherWindow, they are placed as a
// batch instead: shortest context first, each on the survivor with the
// most free blocks left after what the batch already gave it; and each
// survivor gets one reservation and one install for its share, in that
// order, so that its longest prefills come last and its own streams
// decode between the chunks of them (vLLM's chunked prefill; vhi sim's
// step budget).

// placement is where a gathered stream went, or why nowhere.
type placement struct {
	url, id, outcome string
	err              error
}

// waiting is a stream waiting for its batch to be placed.
type waiting struct {
	s     *proxy.Stream
	state hooks.RequestState
	done  chan placement // buffered: the batch never blocks on a waiter
}

// context is the tokens a survivor recomputes for the stream.
func (w *waiting) context() int {
	return len(w.state.PromptTokenIDs) + len(w.state.OutputTokenIDs)
}

// gathering is the batch of one dead instance's streams of one model.
type gathering struct{ list []*waiting }

// placeGathered joins s to the batch of its dead instance's streams (the
// first one to arrive starts the window) and returns where the batch put
// it. A client that left meanwhile has its new copy dropped again.
func (m *Manager) placeGathered(ctx context.Context, s *proxy.Stream, state hooks.RequestState) (url, id, outcome string, err error) {
	key := s.Model + "\x00" + s.Instance
	w := &waiting{s: s, state: state, done: make(chan placement, 1)}
	m.mu.Lock()
	g := m.gathering[key]
	first := g == nil
	if first {
		g = &gathering{}
		m.gathering[key] = g
	}
	g.list = append(g.list, w)
	m.mu.Unlock()
	if first {
		go func() {
			time.Sleep(m.cfg.GatherWindow)
			m.mu.Lock()
			delete(m.gathering, key)
			batch := g.list
			m.mu.Unlock()
			m.placeBatch(batch)
		}()
	}
	// The batch answers within the window and one recovery's timeout
	// (placeBatch bounds every call by it).
	p := <-w.done
	if p.err == nil && ctx.Err() != nil {
		m.dropOn(p.url, p.id, s.ID)
		return "", "", OutcomeFailed, fmt.Errorf("the client left while its stream was recovered: %w", ctx.Err())
	}
	return p.url, p.id, p.outcome, p.err
}

// placeBatch spreads a batch over the survivors and installs each one's
// share; a survivor that refuses its share has each of its streams placed
// alone, on whichever survivor takes it.
func (m *Manager) placeBatch(batch []*waiting) {
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.Timeout)
	defer cancel()
	// A stream is its relay's again once its waiter is answered (the relay
	// moves it to its new instance): what the log needs is read first.
	from := batch[0].s.Instance
	targets := m.awaitTargets(ctx, batch[0].s, m.targets)
	if len(targets) == 0 {
		for _, w := range batch {
			w.done <- placement{outcome: OutcomeNoTarget, err: fmt.Errorf("no healthy instance of %s besides %s can take the stream", w.s.Model, w.s.Instance)}
		}
		return
	}
	shares := spread(batch, targets)
	var installs atomic.Int64
	var wg sync.WaitGroup
	for i, share := range shares {
		if len(share) == 0 {
			continue
		}
		t := targets[i]
		wg.Go(func() {
			parts := split(share, m.cfg.RecomputePerStep)
			installs.Add(int64(len(parts)))
			states := make([][]hooks.RequestState, len(parts))
			for j, part := range parts {
				for _, w := range part {
					states[j] = append(states[j], w.state)
				}
			}
			placed := 0 // parts installed, their clients told
			err := m.installParts(ctx, t, states, func(j int) {
				for _, w := range parts[j] {
					w.done <- placement{url: t.Engine.URL, id: t.ID, outcome: OutcomeRecovered}
				}
				placed = j + 1
			})
			if err != nil {
				m.log.Info("a survivor refused its share of a dead engine's streams; placing the rest one by one",
					zap.String("target", t.ID), zap.Int("parts_installed", placed), zap.Int("parts", len(parts)), zap.Error(err))
				for _, part := range parts[placed:] {
					for _, w := range part {
						url, id, outcome, err := m.placeAlone(ctx, w.s, w.state)
						w.done <- placement{url, id, outcome, err}
					}
				}
			}
		})
	}
	wg.Wait()
	if len(batch) > 1 {
		counts := make([]zap.Field, 0, len(targets))
		for i, share := range shares {
			counts = append(counts, zap.Int(targets[i].ID, len(share)))
		}
		m.log.Info("a dead engine's streams placed together", append(counts, zap.String("from", from),
			zap.Int("streams", len(batch)), zap.Int64("installs", installs.Load()))...)
	}
}

// spread assigns the batch, shortest context first, each stream to the
// target with the most free blocks left (targets' free blocks as their
// last heartbeat said, less what the batch gave them); each target's
// share is in that order.
func spread(batch []*waiting, targets []registry.Instance) [][]*waiting {
	sorted := slices.Clone(batch)
	slices.SortStableFunc(sorted, func(a, b *waiting) int { return cmp.Compare(a.context(), b.context()) })
	free := make([]int, len(targets))
	for i, t := range targets {
		free[i] = t.Stats.FreeBlocks
	}
	shares := make([][]*waiting, len(targets))
	for _, w := range sorted {
		best := 0
		for i := range free {
			if free[i] > free[best] {
				best = i
			}
		}
		shares[best] = append(shares[best], w)
		bs := targets[best].Engine.Geometry.BlockSize
		if bs <= 0 {
			bs = 16
		}
		free[best] -= (tokensNeeded(w.state) + bs - 1) / bs
	}
	return shares
}

// split cuts a survivor's share, in its order, into parts of at most
// perStep tokens of context (at least one stream each); 0: one part.
func split(share []*waiting, perStep int) [][]*waiting {
	if perStep <= 0 {
		return [][]*waiting{share}
	}
	var parts [][]*waiting
	sum := 0
	for _, w := range share {
		if n := len(parts); n == 0 || sum+w.context() > perStep && len(parts[n-1]) > 0 {
			parts = append(parts, nil)
			sum = 0
		}
		parts[len(parts)-1] = append(parts[len(parts)-1], w)
		sum += w.context()
	}
	return parts
}

// waitPrefilled waits, polling the survivor's requests, until each of
// part's has its context computed or a token past it (or is gone):
// then its prefill is done and the next part's may start. A failed poll
// or the context's end stops the wait: the next part goes in anyway.
func (m *Manager) waitPrefilled(ctx context.Context, a agentclient.Agent, part []hooks.RequestState) {
	for {
		list, err := a.Engine.Requests(ctx)
		if err != nil {
			return
		}
		byID := make(map[string]hooks.RequestInfo, len(list.Requests))
		for _, r := range list.Requests {
			byID[r.RequestID] = r
		}
		pending := false
		for _, st := range part {
			r, ok := byID[st.RequestID]
			if ok && r.NumComputedTokens < len(st.PromptTokenIDs)+len(st.OutputTokenIDs) && r.NumOutputTokens <= len(st.OutputTokenIDs) {
				pending = true
				break
			}
		}
		if !pending {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// tokensNeeded is what a survivor reserves for a recovered request: its
// prompt and every token it may still produce.
func tokensNeeded(st hooks.RequestState) int {
	return len(st.PromptTokenIDs) + max(st.Sampling.MaxTokens, len(st.OutputTokenIDs)+1)
}

// dropOn drops request id from the instance at url, whose install the
// client no longer waits for.
func (m *Manager) dropOn(url, instance, id string) {
	t, err := m.reg.Get(instance)
	if err != nil || t.Engine.URL != url {
		return
	}
	a, err := m.agents.Get(t.AgentAddress, t.TLS)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.cfg.Timeout)
	defer cancel()
	_, _ = a.Engine.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{id}, Silent: true, IgnoreMissing: true})
}

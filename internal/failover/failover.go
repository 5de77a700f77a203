// Package failover continues a client's stream on another instance when
// its engine dies mid-stream. The Host snapshots, on an interval, the
// state of every stream it relays from a migratable engine (prompt and
// output token ids, sampling parameters: the export hook's snapshot, the
// same the stage hook uses). When a stream's upstream breaks (the
// process was killed, its connection reset) the relay asks Recover: the
// latest snapshot, cut to the tokens the client already has, is installed
// on a healthy instance of the model as a request to recompute — vLLM's
// preempted-request path, the prefill of prompt plus output — and the
// client's stream goes on from that instance's next token. A request the
// engine samples deterministically (greedy, or seeded: the sim draws from
// its seed and position) goes on exactly as it would have; nothing is
// repeated or lost, and where that cannot be made sure the stream ends
// with an error as before.
package failover

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/periodic"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// Config tunes failover. SnapshotInterval 0 turns it off.
type Config struct {
	SnapshotInterval time.Duration
	// MaxPerModel bounds the recoveries of one model at once (a dead
	// engine's streams all arrive together; the rest end with an error).
	MaxPerModel int
	// Timeout bounds one recovery (install on the target and attach).
	Timeout time.Duration
	// RelayTokenIDs: the relay asks the engines for each stream's token
	// ids (return_token_ids, hidden from clients), so that a recovery
	// takes exactly the client's tokens rather than the last snapshot's.
	RelayTokenIDs bool
	// GatherWindow is how long the first broken stream of a dead engine
	// waits for the others, to place them together over the survivors
	// (spread.go); 0 places each alone.
	GatherWindow time.Duration
	// RecomputePerStep, with GatherWindow, feeds each survivor its share
	// of a dead engine's streams in installs of at most this many tokens
	// of context, each once the last one's prefill is done, so that the
	// survivor's own streams see short steps (0: the whole share at once).
	RecomputePerStep int
	// WarmTokens > 0 keeps a warm copy of every stream whose context
	// reached this many tokens on another instance of its model (a
	// migration's copy rounds each snapshot interval, no switch), so that
	// its failover installs the copy and computes only the tokens since
	// (standby.go). 0: off.
	WarmTokens int
	// NewStreamSnapshot is how soon a stream the Host has no snapshot of
	// gets one: a vLLM stream that already sent tokens cannot go on
	// without one (its sampling state comes from it), and waiting for the
	// next SnapshotInterval left streams younger than it with nowhere to
	// go. 0: at the next interval only.
	NewStreamSnapshot time.Duration
	// WarmInterval is how often the warm copies get a round: what a
	// failover computes again is about this much of each stream's decode.
	WarmInterval time.Duration
	// InjectWarmFault is a data-plane fault every warm round is sent with
	// (transfer.ParseFault: "silent_corrupt", say). Tests only: no flag
	// sets it.
	InjectWarmFault string
}

// DefaultConfig is off, with the limits a user turning it on starts from.
func DefaultConfig() Config {
	return Config{MaxPerModel: 256, Timeout: 10 * time.Second, RelayTokenIDs: true, GatherWindow: 10 * time.Millisecond,
		NewStreamSnapshot: 100 * time.Millisecond, WarmInterval: 200 * time.Millisecond}
}

// Check says what is wrong with c.
func (c Config) Check() error {
	if c.SnapshotInterval < 0 || c.MaxPerModel < 1 || c.Timeout <= 0 || c.GatherWindow < 0 || c.GatherWindow >= c.Timeout || c.RecomputePerStep < 0 || c.WarmTokens < 0 || c.NewStreamSnapshot < 0 ||
		(c.WarmTokens > 0 && (c.WarmInterval <= 0 || c.WarmInterval >= c.Timeout)) {
		return fmt.Errorf("failover: snapshot interval ≥ 0, max per model ≥ 1, timeout > 0, 0 ≤ gather window < timeout, recompute per step ≥ 0, warm standby tokens ≥ 0, 0 < warm standby interval < timeout, new-stream snapshot ≥ 0")
	}
	return nil
}

// Outcomes of a recovery (the vhi_failovers_total label).
const (
	OutcomeRecovered = "recovered"
	OutcomeWarm      = "warm"      // recovered on the standby that held a warm copy of its KV
	OutcomeReplayed  = "replayed"  // no snapshot: the request was sent again, what the client had skipped
	OutcomeNoState   = "no_state"  // no snapshot of the stream (too young, or failover off)
	OutcomeNoTarget  = "no_target" // no healthy instance of the model could take it
	OutcomeLimited   = "limited"   // MaxPerModel recoveries of the model ran already
	OutcomeFailed    = "failed"    // the target refused, or the client's place was uncertain
)

// Metrics are failover's instruments.
type Metrics struct {
	Failovers *prometheus.CounterVec
	Seconds   prometheus.Histogram
	// The warm standbys: streams with a copy, bytes copied, tokens whose
	// KV a recovery installed rather than recomputed.
	WarmCopies prometheus.Gauge
	WarmBytes  prometheus.Counter
	WarmTokens prometheus.Counter
	// WarmDiffer counts copies dropped because they differed from their
	// source's KV when checked (warmcheck.go).
	WarmDiffer prometheus.Counter
}

// NewMetrics makes them, named vhi_failover*.
func NewMetrics() *Metrics {
	return &Metrics{
		Failovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vhi_failovers_total", Help: "Streams whose engine died mid-stream, by outcome (recovered on another instance from a snapshot, replayed there, no_state, no_target, limited, failed).",
		}, []string{"outcome"}),
		Seconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "vhi_failover_seconds", Help: "Recovered streams: from the broken read to the target's stream opened (its first token comes after the recompute).",
			Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5},
		}),
		WarmCopies: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "vhi_failover_warm_copies", Help: "Streams whose KV has a warm copy on another instance that a failover could install now, checked against its source (--failover-warm-standby-tokens).",
		}),
		WarmBytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_failover_warm_bytes_total", Help: "KV bytes copied to warm standbys.",
		}),
		WarmTokens: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_failover_warm_tokens_total", Help: "Context tokens whose KV recoveries installed from warm copies instead of recomputing.",
		}),
		WarmDiffer: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "vhi_failover_warm_copies_differed_total", Help: "Warm copies dropped because the standby's KV differed from the source's when checked after a round.",
		}),
	}
}

// Collectors lists the instruments for registration.
func (m *Metrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{m.Failovers, m.Seconds, m.WarmCopies, m.WarmBytes, m.WarmTokens, m.WarmDiffer}
}

// Manager keeps the snapshots and recovers streams.
type Manager struct {
	cfg     Config
	reg     *registry.Registry
	agents  *agentclient.Pool
	streams *proxy.Streams
	met     *Metrics
	log     *zap.Logger

	mu        sync.Mutex
	states    map[string]hooks.RequestState // by request id: the latest snapshot
	inflight  map[string]int                // recoveries running, by model
	gathering map[string]*gathering         // by model and dead instance: streams waiting to be placed together

	warm *standbys // the warm copies (standby.go)
}

// New returns a manager (met may be nil).
func New(cfg Config, reg *registry.Registry, agents *agentclient.Pool, streams *proxy.Streams, met *Metrics, log *zap.Logger) *Manager {
	return &Manager{cfg: cfg, reg: reg, agents: agents, streams: streams, met: met, log: log,
		states: map[string]hooks.RequestState{}, inflight: map[string]int{}, gathering: map[string]*gathering{}, warm: newStandbys()}
}

// Enabled reports whether failover is on.
func (m *Manager) Enabled() bool { return m.cfg.SnapshotInterval > 0 }

// RelaysTokenIDs reports whether the relay should ask for streams' token
// ids (failover on, and RelayTokenIDs).
func (m *Manager) RelaysTokenIDs() bool { return m.Enabled() && m.cfg.RelayTokenIDs }

// Run snapshots every interval until ctx ends (nothing when off).
func (m *Manager) Run(ctx context.Context) {
	if !m.Enabled() {
		return
	}
	m.log.Info("failover on", zap.Duration("snapshot_interval", m.cfg.SnapshotInterval), zap.Int("max_per_model", m.cfg.MaxPerModel),
		zap.Int("warm_standby_tokens", m.cfg.WarmTokens), zap.Duration("warm_standby_interval", m.cfg.WarmInterval))
	if m.cfg.WarmTokens > 0 {
		go periodic.Do(ctx, m.cfg.WarmInterval, func() { m.keepWarm(ctx) })
	}
	if n := m.cfg.NewStreamSnapshot; n > 0 && n < m.cfg.SnapshotInterval {
		go periodic.Do(ctx, n, func() { m.snapshotNew(ctx) })
	}
	periodic.Do(ctx, m.cfg.SnapshotInterval, func() {
		m.snapshot(ctx)
		m.abandonUnhealthy()
	})
}

// snapshot reads the state of every relayed stream from its engine, and
// forgets the streams that ended.
func (m *Manager) snapshot(ctx context.Context) {
	byInstance := m.streams.IDsByInstance()
	fresh := m.export(ctx, byInstance)
	live := map[string]bool{}
	for _, ids := range byInstance {
		for _, id := range ids {
			live[id] = true
		}
	}
	m.mu.Lock()
	for id := range m.states {
		if !live[id] {
			delete(m.states, id)
		}
	}
	for id, st := range fresh {
		m.states[id] = st
	}
	m.mu.Unlock()
}

// snapshotNew reads the state of the relayed streams that have no
// snapshot yet (Config.NewStreamSnapshot).
func (m *Manager) snapshotNew(ctx context.Context) {
	byInstance := m.streams.IDsByInstance()
	m.mu.Lock()
	n := 0
	for in, ids := range byInstance {
		var missing []string
		for _, id := range ids {
			if _, ok := m.states[id]; !ok {
				missing = append(missing, id)
			}
		}
		byInstance[in] = missing
		n += len(missing)
	}
	m.mu.Unlock()
	if n == 0 {
		return
	}
	fresh := m.export(ctx, byInstance)
	m.mu.Lock()
	for id, st := range fresh {
		if _, ok := m.states[id]; !ok {
			m.states[id] = st
		}
	}
	m.mu.Unlock()
}

// export snapshots the streams of byInstance on their engines (an
// instance that cannot answer is left out).
func (m *Manager) export(ctx context.Context, byInstance map[string][]string) map[string]hooks.RequestState {
	fresh := map[string]hooks.RequestState{}
	for _, in := range m.reg.List() {
		ids := byInstance[in.ID]
		if len(ids) == 0 || !in.Engine.Migratable || !in.Reachable {
			continue
		}
		a, err := m.agents.Get(in.AgentAddress, in.TLS)
		if err != nil {
			continue
		}
		// Bounded by the recovery timeout too: with snapshots an hour
		// apart, a new stream's export must not wait that long.
		cctx, cancel := context.WithTimeout(ctx, min(m.cfg.SnapshotInterval, m.cfg.Timeout)+time.Second)
		out, err := a.Engine.Export(cctx, hooks.ExportRequest{RequestIDs: ids, Snapshot: true})
		cancel()
		if err != nil {
			m.log.Debug("snapshot failed", zap.String("vllm_hi_id", in.ID), zap.Error(err))
			continue
		}
		for _, st := range out.Requests {
			fresh[st.RequestID] = st
		}
	}
	return fresh
}

// abandonUnhealthy fails over the silent streams of every instance the
// registry holds unhealthy — its agent missed its heartbeats, or reports
// its engine dead or hung — without waiting for their connections to
// break (a hung engine's may never) or for the relay's idle timeout. A
// stream still getting tokens is left alone: the engine serves it; so is
// one that no other active instance of its model could take (its engine
// may only be slow — a starved agent misses heartbeats too — and cutting
// it would end it with an error for certain).
func (m *Manager) abandonUnhealthy() {
	instances := m.reg.List()
	elsewhere := func(s *proxy.Stream) bool {
		for _, in := range instances {
			if in.ID != s.Instance && in.Lifecycle() == registry.LifecycleActive && in.Serves(s.Model) {
				return true
			}
		}
		return false
	}
	for _, in := range instances {
		if in.Lifecycle() != registry.LifecycleUnhealthy || !in.Engine.Migratable {
			continue
		}
		if n := m.streams.Abandon(in.ID, m.cfg.SnapshotInterval, elsewhere); n > 0 {
			m.log.Warn("failing over the silent streams of an unhealthy instance", zap.String("vllm_hi_id", in.ID),
				zap.Bool("agent_reachable", in.Reachable), zap.Int("streams", n))
		}
	}
}

// Recover installs stream s — whose engine's stream broke after the
// client got `sent` token events and `text` code points — on another
// healthy instance of its model, to go on from the next token, and
// returns that instance's base URL and id.
func (m *Manager) Recover(ctx context.Context, s *proxy.Stream, sent, text int) (proxy.Recovery, error) {
	start := time.Now()
	rec, outcome, err := m.recover(ctx, s, sent, text)
	if m.met != nil {
		m.met.Failovers.WithLabelValues(outcome).Inc()
		if err == nil {
			m.met.Seconds.Observe(time.Since(start).Seconds())
		}
	}
	if err != nil {
		m.log.Warn("failover failed", zap.String("request_id", s.ID), zap.String("from", s.Instance), zap.String("outcome", outcome), zap.Error(err))
		return rec, err
	}
	m.log.Info("stream recovered on another instance", zap.String("request_id", s.ID), zap.String("from", s.Instance), zap.String("to", rec.Instance),
		zap.String("outcome", outcome), zap.Int("tokens_sent", sent), zap.Duration("took", time.Since(start)))
	return rec, nil
}

var errOff = errors.New("failover is off (vhi host --failover-snapshot-interval)")

// deterministicEngine is the engine kind whose replay of a request gives
// the same tokens whatever the batch (vhi sim derives each token from its
// seed, position and KV); vLLM's numerics follow its batches.
const deterministicEngine = "vhi-sim"

func (m *Manager) recover(ctx context.Context, s *proxy.Stream, sent, text int) (proxy.Recovery, string, error) {
	if !m.Enabled() {
		return proxy.Recovery{}, OutcomeNoState, errOff
	}
	m.mu.Lock()
	st, ok := m.states[s.ID]
	m.mu.Unlock()
	if !ok {
		return m.replay(ctx, s, sent)
	}
	if state, ok := withRelayedIDs(st, s); ok {
		// The relay knows the client's tokens exactly (vLLM's token ids):
		// the survivor takes those, however old the snapshot, and the
		// stream opens after them.
		url, id, outcome, err := m.reinstallState(ctx, s, state)
		if err == nil {
			return proxy.Recovery{BaseURL: url, Instance: id, From: len(state.OutputTokenIDs)}, outcome, nil
		}
		if outcome == OutcomeLimited {
			return proxy.Recovery{}, outcome, err
		}
		m.log.Info("reinstalling from the relayed token ids failed; trying the snapshot", zap.String("request_id", s.ID), zap.Error(err))
	}
	url, id, outcome, err := m.reinstall(ctx, s, st, sent, text)
	if err != nil && outcome != OutcomeLimited {
		// No target took the snapshot (an agent restarting, say): a
		// replay needs only the engine, where it is exact.
		if rec, routcome, rerr := m.replay(ctx, s, sent); rerr == nil {
			m.log.Info("reinstalling failed; replaying instead", zap.String("request_id", s.ID), zap.Error(err))
			return rec, routcome, nil
		}
	}
	return proxy.Recovery{BaseURL: url, Instance: id}, outcome, err
}

// replay is the way on for a stream without a snapshot (younger than an
// interval, or from an engine without hooks): its request is sent again to
// another instance and what the client has is skipped — when the client
// has nothing yet, or its engine replays exactly.
func (m *Manager) replay(ctx context.Context, s *proxy.Stream, sent int) (proxy.Recovery, string, error) {
	kind := s.EngineKind
	if old, err := m.reg.Get(s.Instance); err == nil {
		kind = old.Engine.Kind
	}
	switch {
	case !s.CanReplay():
		return proxy.Recovery{}, OutcomeNoState, fmt.Errorf("no snapshot of stream %s, and its request was too large to keep", s.ID)
	case sent > 0 && kind != deterministicEngine:
		return proxy.Recovery{}, OutcomeNoState, fmt.Errorf("no snapshot of stream %s yet, and a replay on %q engines may not repeat its %d tokens", s.ID, kind, sent)
	}
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	if ts := m.awaitTargets(ctx, s, m.replayTargets); len(ts) > 0 {
		return proxy.Recovery{BaseURL: ts[0].Engine.URL, Instance: ts[0].ID, Replay: true}, OutcomeReplayed, nil
	}
	return proxy.Recovery{}, OutcomeNoTarget, fmt.Errorf("no healthy instance of %s besides %s can take the stream", s.Model, s.Instance)
}

// replayTargets are the instances a request can be sent again to: active,
// serving s's model, not the one that died (no hooks needed).
func (m *Manager) replayTargets(s *proxy.Stream) []registry.Instance {
	var out []registry.Instance
	for _, in := range m.reg.List() {
		if in.ID != s.Instance && in.Lifecycle() == registry.LifecycleActive && in.Serves(s.Model) {
			out = append(out, in)
		}
	}
	return out
}

// withRelayedIDs is the snapshot st (its sampling and engine state: what
// a request's life does not change) with the tokens the client got as
// the relay read them from vLLM: ok false when the relay does not know
// them, or its prompt is not the snapshot's (then the snapshot's own cut
// decides).
func withRelayedIDs(st hooks.RequestState, s *proxy.Stream) (hooks.RequestState, bool) {
	prompt, output, ok := s.TokenIDs()
	if !ok || !slices.Equal(prompt, []int(st.PromptTokenIDs)) {
		return st, false
	}
	out := st
	out.OutputTokenIDs = hooks.IntList(output)
	// The text is the target's to derive from the ids (its detokenizer
	// replays them); the snapshot's offsets are for its own tokens.
	out.OutputText, out.TextOffsets = "", nil
	out.RNGPosition = len(output)
	out.NumComputedTokens = 0
	return out, true
}

// reinstall installs the snapshot, cut to the client's place, on another
// instance.
func (m *Manager) reinstall(ctx context.Context, s *proxy.Stream, st hooks.RequestState, sent, text int) (url, id, outcome string, err error) {
	state, err := cut(st, sent, text)
	if err != nil {
		return "", "", OutcomeFailed, err
	}
	return m.reinstallState(ctx, s, state)
}

// reinstallState installs state, a request to recompute from the client's
// place, on another instance.
func (m *Manager) reinstallState(ctx context.Context, s *proxy.Stream, state hooks.RequestState) (url, id, outcome string, err error) {
	if !m.enter(s.Model) {
		return "", "", OutcomeLimited, fmt.Errorf("%d streams of %s are being recovered already", m.cfg.MaxPerModel, s.Model)
	}
	defer m.leave(s.Model)
	if url, id, ok := m.installWarm(ctx, s.ID, s.Instance, state); ok {
		m.abortOn(s)
		return url, id, OutcomeWarm, nil
	}
	if m.cfg.GatherWindow > 0 {
		url, id, outcome, err = m.placeGathered(ctx, s, state)
	} else {
		url, id, outcome, err = m.placeAlone(ctx, s, state)
	}
	if err == nil {
		m.abortOn(s)
	}
	return url, id, outcome, err
}

// placeAlone installs state on the first survivor (the most free KV at
// its last heartbeat) that takes it.
func (m *Manager) placeAlone(ctx context.Context, s *proxy.Stream, state hooks.RequestState) (url, id, outcome string, err error) {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	targets := m.awaitTargets(ctx, s, m.targets)
	if len(targets) == 0 {
		return "", "", OutcomeNoTarget, fmt.Errorf("no healthy instance of %s besides %s can take the stream", s.Model, s.Instance)
	}
	var last error
	for _, t := range targets {
		if err := m.install(ctx, t, []hooks.RequestState{state}); err != nil {
			last = fmt.Errorf("%s: %w", t.ID, err)
			continue
		}
		return t.Engine.URL, t.ID, OutcomeRecovered, nil
	}
	return "", "", OutcomeFailed, last
}

// cut is the snapshot as of the client's place: its first k output
// tokens, where k is the tokens the client got — when the snapshot is
// older, everything it has (the target regenerates the rest, and the
// stream skips them). A client whose text does not end where the
// snapshot says its k-th token ends is refused: its engine merged tokens
// into one event, and going on from a guess could repeat or drop one.
func cut(st hooks.RequestState, sent, text int) (hooks.RequestState, error) {
	n := len(st.OutputTokenIDs)
	k := min(sent, n)
	if k > 0 && len(st.TextOffsets) >= k && text >= 0 && sent <= n && st.TextOffsets[k-1] != text {
		return st, fmt.Errorf("the client's text (%d characters after %d events) does not end at a token of the snapshot (%d after token %d)",
			text, sent, st.TextOffsets[k-1], k)
	}
	out := st
	out.OutputTokenIDs = append(hooks.IntList(nil), st.OutputTokenIDs[:k]...)
	if len(st.TextOffsets) >= k {
		out.TextOffsets = append(hooks.IntList(nil), st.TextOffsets[:k]...)
	}
	visible := 0
	if k > 0 && len(out.TextOffsets) == k {
		visible = out.TextOffsets[k-1]
	}
	r := []rune(st.OutputText)
	out.OutputText = string(r[:min(visible, len(r))])
	out.RNGPosition = k
	out.NumComputedTokens = 0
	return out, nil
}

// targets are the instances that can take s: active, healthy, migratable,
// serving its model, not the one that died; the most free KV first.
func (m *Manager) targets(s *proxy.Stream) []registry.Instance {
	var out []registry.Instance
	for _, in := range m.reg.List() {
		if in.ID == s.Instance || in.Lifecycle() != registry.LifecycleActive || !in.Engine.Migratable || !in.Serves(s.Model) {
			continue
		}
		out = append(out, in)
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Stats.FreeBlocks > out[j].Stats.FreeBlocks })
	return out
}

// targetPoll is how often a recovery waiting for a survivor looks again.
const targetPoll = 50 * time.Millisecond

// awaitTargets is pick(s), waiting for an instance while ctx lasts and
// another instance of s's model is known but unhealthy: its agent may be
// registering again (a new session is taken only once the old one's
// heartbeats were missed), or this Host, one of several sharing a store,
// may not have heard from it since. A stream that broke in that moment
// waits for it rather than ending; with no such instance (the model's
// only other instances standbys, say) it ends at once.
func (m *Manager) awaitTargets(ctx context.Context, s *proxy.Stream, pick func(*proxy.Stream) []registry.Instance) []registry.Instance {
	for {
		if ts := pick(s); len(ts) > 0 || !m.survivorExpected(s) {
			return ts
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(targetPoll):
		}
	}
}

// survivorExpected says whether an active instance of s's model other
// than the one that died is unhealthy now: one a recovery may wait for.
func (m *Manager) survivorExpected(s *proxy.Stream) bool {
	for _, in := range m.reg.List() {
		if in.ID != s.Instance && in.Serves(s.Model) && in.Role == registry.RoleActive && in.Lifecycle() == registry.LifecycleUnhealthy && !in.Retired {
			return true
		}
	}
	return false
}

// install reserves the requests on t as ones to recompute (no KV moves:
// the dead engine's is gone) and installs their states, running, in their
// order: one reservation call and one install call for all of them.
func (m *Manager) install(ctx context.Context, t registry.Instance, states []hooks.RequestState) error {
	return m.installParts(ctx, t, [][]hooks.RequestState{states}, nil)
}

// installParts reserves every part's requests on t in one call, then
// installs the parts in order, each once the last one's prefill is done
// (waitPrefilled), calling installed after each. What a failed install
// left (its part and those after it) is dropped on t again.
func (m *Manager) installParts(ctx context.Context, t registry.Instance, parts [][]hooks.RequestState, installed func(part int)) error {
	a, err := m.agents.Get(t.AgentAddress, t.TLS)
	if err != nil {
		return err
	}
	var items []hooks.AllocateItem
	var ids []string
	for _, part := range parts {
		for _, st := range part {
			items = append(items, hooks.AllocateItem{RequestID: st.RequestID, NumTokens: tokensNeeded(st), Recompute: true})
			ids = append(ids, st.RequestID)
		}
	}
	if _, err := a.Engine.Allocate(ctx, hooks.AllocateRequest{Requests: items}); err != nil {
		// A refused reservation of several may have reserved some.
		_, _ = a.Engine.Abort(context.WithoutCancel(ctx), hooks.AbortRequest{RequestIDs: ids, Silent: true, IgnoreMissing: true})
		return fmt.Errorf("reserve: %w", err)
	}
	done := 0
	for i, part := range parts {
		if i > 0 {
			m.waitPrefilled(ctx, a, parts[i-1])
		}
		if _, err := a.Engine.Install(ctx, hooks.InstallRequest{Requests: part, Resume: true}); err != nil {
			// The reservations' lease frees them; say so at once where we can.
			_, _ = a.Engine.Abort(context.WithoutCancel(ctx), hooks.AbortRequest{RequestIDs: ids[done:], Silent: true, IgnoreMissing: true})
			return fmt.Errorf("install: %w", err)
		}
		done += len(part)
		if installed != nil {
			installed(i)
		}
	}
	return nil
}

// abortOn drops the request from the instance whose stream broke, in
// case only the connection died and the engine still runs it: the client
// reads the target now, and the old copy would only take seats.
func (m *Manager) abortOn(s *proxy.Stream) {
	old, err := m.reg.Get(s.Instance)
	if err != nil || !old.Reachable {
		return
	}
	go func() {
		a, err := m.agents.Get(old.AgentAddress, old.TLS)
		if err != nil {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), m.cfg.Timeout)
		defer cancel()
		_, _ = a.Engine.Abort(ctx, hooks.AbortRequest{RequestIDs: []string{s.ID}, Silent: true, IgnoreMissing: true})
	}()
}

func (m *Manager) enter(model string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.inflight[model] >= m.cfg.MaxPerModel {
		return false
	}
	m.inflight[model]++
	return true
}

func (m *Manager) leave(model string) {
	m.mu.Lock()
	m.inflight[model]--
	m.mu.Unlock()
}

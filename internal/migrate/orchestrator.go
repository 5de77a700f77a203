package migrate

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/agentclient"
	"github.com/vllm-hi/vllm-hi/internal/ends"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/registry"
)

// Orchestrator runs migrations.
type Orchestrator struct {
	cfg     Config
	reg     *registry.Registry
	proxy   *proxy.Proxy
	streams *proxy.Streams
	agents  *agentclient.Pool
	met     *Metrics
	log     *zap.Logger
	rec     *recorder

	// ctx ends at Close: background work (a source's retirement) stops.
	ctx    context.Context
	cancel context.CancelFunc

	mu  sync.Mutex
	all map[string]*migration
	// launching are the migrations whose target is being launched, not
	// yet admitted (launch.go).
	launching map[string]*hostapi.MigrationStatus
	order     []string    // migration ids, oldest first
	ends      ends.Signal // a migration ended (Wait)
	wg        sync.WaitGroup
	// relays are the other Hosts of a shared store (nil: none), whose
	// clients' streams switch too.
	relays RemoteRelays
	// warm are the Host's warm standby copies (nil: none).
	warm WarmCopies
}

// New returns an orchestrator that reaches agents through agents (the
// Host's pool); met and records may be nil (nothing is then counted, or
// kept across restarts).
func New(cfg Config, reg *registry.Registry, px *proxy.Proxy, agents *agentclient.Pool, met *Metrics, records RecordStore, log *zap.Logger) (*Orchestrator, error) {
	if err := cfg.Check(); err != nil {
		return nil, err
	}
	o := &Orchestrator{cfg: cfg, reg: reg, proxy: px, streams: px.Streams(), met: met, log: log,
		agents: agents, all: map[string]*migration{}, launching: map[string]*hostapi.MigrationStatus{}}
	o.ctx, o.cancel = context.WithCancel(context.Background())
	o.rec = newRecorder(records, o, log)
	if cfg.RestoreLater {
		return o, nil
	}
	if err := o.restore(); err != nil {
		return nil, err
	}
	return o, nil
}

// Restore reads the records back (Config.RestoreLater: once this Host
// leads the shared store): a migration that was running when the Host
// that ran it stopped ends, and its target's reservations are released.
func (o *Orchestrator) Restore() error { return o.restore() }

// Close stops background work, waits — until ctx ends — for running
// migrations to roll back or finish, and writes the last records. A
// migration still running then ends with its engines' leases (the source
// resumes, the target frees its blocks).
func (o *Orchestrator) Close(ctx context.Context) {
	o.cancel()
	done := make(chan struct{})
	go func() { o.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		o.log.Warn("migrations still running at shutdown; their engines' leases will end them", zap.Int("running", o.running()))
	}
	o.rec.close()
}

// running counts the migrations not ended.
func (o *Orchestrator) running() int {
	n := 0
	for _, st := range o.List() {
		if !st.Ended() {
			n++
		}
	}
	return n
}

// Start validates a migrate request, reserves both instances, selects the
// requests and reserves their blocks on the target — all before answering,
// so that a bad request or a target that cannot hold the KV is refused
// with nothing started — and then runs the rest in the background.
func (o *Orchestrator) Start(req hostapi.MigrateRequest) (string, error) {
	start := o.start
	if req.Dst == "" && req.Src != "" {
		start = o.startLaunched
	}
	id, err := start(req)
	if err != nil {
		o.met.Refused()
	}
	return id, err
}

func (o *Orchestrator) start(req hostapi.MigrateRequest) (string, error) {
	m, err := o.admit(req, "")
	if err != nil {
		return "", err
	}
	return o.begin(m)
}

// begin prepares an admitted migration and runs it in the background.
func (o *Orchestrator) begin(m *migration) (string, error) {
	if err := m.prepare(); err != nil {
		m.undo()
		o.reg.Release(m.op, m.src.ID, m.dst.ID)
		if errdefs.Kind(err) != errdefs.ErrConflict {
			// Whatever failed while preparing (an agent, an engine), the
			// instances cannot take this migration now.
			err = errdefs.Newf(errdefs.ErrConflict, "%w", err)
		}
		return "", err
	}
	o.add(m)
	o.rec.save(m.st.ID)
	o.wg.Add(2)
	go func() {
		defer o.wg.Done()
		m.run()
	}()
	go func() {
		// Connections to the target for the streams that will move, opened
		// while the copy rounds run.
		defer o.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		o.proxy.Warm(ctx, m.dst.Engine.URL, len(m.moving))
	}()
	return m.st.ID, nil
}

// run is the migration after prepare, phase by phase. Everything up to
// the commit runs under the migration's deadline: a stalled agent or
// engine aborts it rather than holding both instances (and, later, the
// source's pause).
func (m *migration) run() {
	dctx, dcancel := context.WithDeadline(m.o.ctx, m.deadline)
	defer dcancel()
	ctx, cancel := context.WithCancelCause(dctx)
	defer cancel(nil)
	go m.watchTarget(ctx, cancel)
	since, err := m.copyRounds(ctx)
	if err == nil {
		m.crashIf("crash_before_pause", "after the copy rounds, the target holding their KV")
	}
	var staged <-chan struct{}
	if err == nil {
		// The moving streams open on the target now, so that its API
		// server has handled them long before the pause: opened at the
		// pause, 256 of them queued the install's registration behind
		// them there (19–51 ms of the final round, H100, 2026-12-06).
		m.preAttach()
		// The state the target can prepare from a snapshot goes over
		// while the check of what is on the target already runs, both
		// while the source decodes.
		staged = m.stageState(ctx)
		since, err = m.checkCopied(ctx, since)
	}
	if staged != nil {
		checked := time.Now()
		<-staged
		if err == nil {
			m.topUpStage(ctx)
			since, err = m.roundAfterStage(ctx, since, time.Since(checked))
		}
	}
	var c committed
	if err == nil {
		c, err = m.final(ctx, since)
	}
	if err != nil {
		if silent := targetSilence(ctx); silent != nil {
			// What the calls then failed with is the heartbeat's doing.
			err = fmt.Errorf("%w (the migration was at: %v)", silent, err)
		}
		m.abort(err)
		return
	}
	m.crashIf("crash_after_commit", "after the commit, before the streams switch")
	m.switchOver(c)
}

// Get returns a migration's status.
func (o *Orchestrator) Get(id string) (hostapi.MigrationStatus, bool) {
	o.mu.Lock()
	m, ok := o.all[id]
	l := o.launching[id]
	var ls hostapi.MigrationStatus
	if l != nil {
		ls = *l
		ls.StepHistory = append([]hostapi.Step(nil), l.StepHistory...)
		if l.Launched != nil {
			t := *l.Launched
			ls.Launched = &t
		}
	}
	o.mu.Unlock()
	if l != nil {
		return ls, true
	}
	if !ok {
		return hostapi.MigrationStatus{}, false
	}
	return m.status(), true
}

// List returns every migration, newest first.
func (o *Orchestrator) List() []hostapi.MigrationStatus {
	o.mu.Lock()
	ids := append([]string(nil), o.order...)
	o.mu.Unlock()
	out := make([]hostapi.MigrationStatus, 0, len(ids))
	for _, id := range slices.Backward(ids) { // newest first
		if s, ok := o.Get(id); ok {
			out = append(out, s)
		}
	}
	return out
}

// add records a new migration, dropping the oldest finished ones beyond
// the history bound.
func (o *Orchestrator) add(m *migration) {
	o.mu.Lock()
	o.all[m.st.ID] = m
	if o.launching[m.st.ID] != nil {
		delete(o.launching, m.st.ID) // in the order since its launch began
	} else {
		o.order = append(o.order, m.st.ID)
	}
	var dropped []string
	for i := 0; len(o.order)-len(dropped) > o.cfg.MaxHistory && i < len(o.order); i++ {
		id := o.order[i]
		if m := o.all[id]; m != nil && m.status().State != hostapi.StateRunning {
			dropped = append(dropped, id)
		} else if l := o.launching[id]; l != nil && l.State != hostapi.StateRunning {
			dropped = append(dropped, id)
		}
	}
	if len(dropped) > 0 {
		gone := map[string]bool{}
		for _, id := range dropped {
			gone[id] = true
			delete(o.all, id)
			delete(o.launching, id)
		}
		kept := o.order[:0]
		for _, id := range o.order {
			if !gone[id] {
				kept = append(kept, id)
			}
		}
		o.order = kept
	}
	o.mu.Unlock()
	for _, id := range dropped {
		o.rec.forget(id)
	}
}

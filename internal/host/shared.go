package host

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/migrate"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
	"github.com/vllm-hi/vllm-hi/internal/store"
)

// Several Hosts on one shared store (etcd): every one serves clients —
// the OpenAI and vLLM routes, the status, the instances — and relays
// their streams; the one leading the store decides: it writes the
// records, runs migrations, drains, scaling and model switching, and
// answers the agents' drains. A Host that follows forwards those
// requests to the leader, takes the leader's decisions about instances
// from the store as they are written, and switches its own clients'
// streams when a migration the leader runs commits (the switch board).
// When the leader dies, one of the others leads from its lease's end.

// sharedStore is what the Host uses of a store several Hosts share
// (store.Etcd).
type sharedStore interface {
	store.Store
	Campaign(context.Context) error
	Rejoin(context.Context) error
	Leading() <-chan struct{}
	Leads() bool
	Me() store.Member
	Leader(context.Context) (store.Member, bool, error)
	Members(context.Context) ([]store.Member, error)
	Resign(context.Context) error
	WatchInstances(context.Context, func(string, *store.Instance))
	Post(board, id string, v any) error
	Unpost(board, id string)
	WatchBoard(ctx context.Context, board string, fn func(id string, v []byte))
	Answer(board, id string, v any) error
	Answers(ctx context.Context, board, id string, hosts []string) map[string][]byte
}

// leads reports whether this Host decides: it leads its shared store
// (and took the last leader's state over), or has none to share.
func (h *Host) leads() bool { return h.shared == nil || h.tookOver.Load() }

// leaderWrites is the registry's store on a shared one: a Host that
// follows writes nothing (the leader's records are the truth it adopts).
type leaderWrites struct{ s sharedStore }

func (l leaderWrites) PutInstance(i store.Instance) error {
	if !l.s.Leads() {
		return nil
	}
	return l.s.PutInstance(i)
}

func (l leaderWrites) DeleteInstance(id string) error {
	if !l.s.Leads() {
		return nil
	}
	return l.s.DeleteInstance(id)
}

// follow, until this Host leads or ctx ends, adopts the leader's records
// of instances as they are written, and switches this Host's streams of
// the leader's migrations.
func (h *Host) follow(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-h.shared.Leading():
		case <-ctx.Done():
		}
		cancel()
	}()
	var wg sync.WaitGroup
	wg.Go(func() {
		h.shared.WatchInstances(ctx, func(id string, rec *store.Instance) {
			switch {
			case h.shared.Leads():
			case rec != nil:
				h.reg.Adopt(*rec)
			default:
				// The leader forgot it (DELETE /vllm_hi/instances/{id}):
				// so does this Host, unless its agent still heartbeats here.
				_ = h.reg.Forget(id)
			}
		})
	})
	wg.Go(func() { h.shared.WatchBoard(ctx, store.BoardCensus, h.answerCensus) })
	wg.Go(func() {
		h.shared.WatchBoard(ctx, store.BoardSwitch, func(_ string, v []byte) {
			var sw store.Switch
			if json.Unmarshal(v, &sw) == nil {
				h.applySwitch(sw)
			}
		})
	})
	wg.Wait()
}

// answerCensus says which of a migration's candidate requests this Host
// relays.
func (h *Host) answerCensus(id string, v []byte) {
	var c store.Census
	if h.leads() || json.Unmarshal(v, &c) != nil {
		return
	}
	ans := store.CensusAnswer{Host: h.shared.Me().ID, Streams: map[string]store.RelayedStream{}}
	for _, rid := range c.RequestIDs {
		if s := h.proxy.Streams().Get(rid); s != nil {
			ans.Streams[rid] = store.RelayedStream{Model: s.Model, Tag: s.Tag, Started: s.Started, Instance: s.Upstream()}
		}
	}
	if err := h.shared.Answer(store.BoardCensus, id, ans); err != nil {
		h.log.Warn("answering a migration's census failed", zap.String("migration_id", id), zap.Error(err))
	}
}

// applySwitch switches the streams this Host relays of a migration that
// another Host committed, and answers which did (every Host answers, if
// only to say it relays none: the leader waits for each).
func (h *Host) applySwitch(sw store.Switch) {
	if h.leads() {
		return // this Host's own migration (it switched its streams itself)
	}
	go func() {
		ack := store.SwitchAck{Failed: map[string]string{}}
		type pending struct {
			id string
			ch <-chan error
		}
		var waits []pending
		for _, ss := range sw.Streams {
			s := h.proxy.Streams().Get(ss.ID)
			if s == nil {
				continue
			}
			var ch <-chan error
			if ss.Cut {
				ch = s.Cut(sw.EngineURL, sw.Instance, ss.From, ss.Text, -1)
			} else {
				ch = s.Splice(sw.EngineURL, sw.Instance, ss.From, ss.Text)
			}
			waits = append(waits, pending{ss.ID, ch})
		}
		timeout := time.After(h.cfg.Migration.SpliceTimeout)
		for _, p := range waits {
			select {
			case err := <-p.ch:
				if err != nil {
					ack.Failed[p.id] = err.Error()
				} else {
					ack.Switched = append(ack.Switched, p.id)
				}
			case <-timeout:
				ack.Failed[p.id] = "still switching at the splice timeout"
			}
		}
		h.m.hostSwitches.WithLabelValues("switched").Add(float64(len(ack.Switched)))
		h.m.hostSwitches.WithLabelValues("failed").Add(float64(len(ack.Failed)))
		ack.Host = h.shared.Me().ID
		if err := h.shared.Answer(store.BoardSwitch, sw.Migration, ack); err != nil {
			h.log.Warn("answering a migration's switch failed", zap.String("migration_id", sw.Migration), zap.Error(err))
		}
		if len(waits) > 0 {
			h.log.Info("switched the streams of another Host's migration", zap.String("migration_id", sw.Migration),
				zap.Int("switched", len(ack.Switched)), zap.Int("failed", len(ack.Failed)))
		}
	}()
}

// relays are the other Hosts as the orchestrator sees them.
type relays struct{ h *Host }

// others are the other Hosts of the store now.
func (r relays) others() []string {
	h := r.h
	ctx, cancel := context.WithTimeout(context.Background(), h.cfg.Migration.RPCTimeout)
	members, err := h.shared.Members(ctx)
	cancel()
	if err != nil {
		h.log.Warn("listing the other Hosts failed", zap.Error(err))
	}
	var others []string
	for _, m := range members {
		if m.ID != h.shared.Me().ID {
			others = append(others, m.ID)
		}
	}
	return others
}

// Census implements migrate.RemoteRelays.
func (r relays) Census(ctx context.Context, migration string, ids []string) map[string]store.RelayedStream {
	others := r.others()
	if len(others) == 0 || len(ids) == 0 {
		return nil
	}
	h := r.h
	if err := h.shared.Post(store.BoardCensus, migration, store.Census{Migration: migration, RequestIDs: ids}); err != nil {
		h.log.Warn("asking the other Hosts which streams they relay failed (this migration moves this Host's only)", zap.Error(err))
		return nil
	}
	defer h.shared.Unpost(store.BoardCensus, migration)
	answers := h.shared.Answers(ctx, store.BoardCensus, migration, others)
	if len(answers) < len(others) {
		h.log.Warn("some Hosts did not say which streams they relay in time (this migration leaves their streams where they are)",
			zap.String("migration_id", migration), zap.Int("answered", len(answers)), zap.Int("hosts", len(others)))
	}
	out := map[string]store.RelayedStream{}
	for _, v := range answers {
		var a store.CensusAnswer
		if json.Unmarshal(v, &a) == nil {
			maps.Copy(out, a.Streams)
		}
	}
	return out
}

// Switch implements migrate.RemoteRelays.
func (r relays) Switch(sw store.Switch) func(context.Context) (map[string]bool, map[string]string) {
	h := r.h
	others := r.others()
	if len(others) == 0 {
		return func(context.Context) (map[string]bool, map[string]string) { return nil, nil }
	}
	if err := h.shared.Post(store.BoardSwitch, sw.Migration, sw); err != nil {
		h.log.Warn("publishing a switch to the other Hosts failed (their clients' streams of it end)", zap.String("migration_id", sw.Migration), zap.Error(err))
		return func(context.Context) (map[string]bool, map[string]string) { return nil, nil }
	}
	return func(ctx context.Context) (map[string]bool, map[string]string) {
		defer h.shared.Unpost(store.BoardSwitch, sw.Migration)
		answers := h.shared.Answers(ctx, store.BoardSwitch, sw.Migration, others)
		switched, failed := map[string]bool{}, map[string]string{}
		for _, v := range answers {
			var a store.SwitchAck
			if json.Unmarshal(v, &a) != nil {
				continue
			}
			for _, id := range a.Switched {
				switched[id] = true
			}
			maps.Copy(failed, a.Failed)
		}
		if len(answers) < len(others) {
			h.log.Warn("some Hosts did not answer a switch in time (their clients' streams of it end)",
				zap.String("migration_id", sw.Migration), zap.Int("answered", len(answers)), zap.Int("hosts", len(others)))
		}
		return switched, failed
	}
}

var _ migrate.RemoteRelays = relays{}

// toLeader serves a request that only the leader may answer (it decides,
// or keeps the operation's state) on a Host that follows by forwarding it
// to the leader: every Host serves the whole REST surface.
func (h *Host) toLeader(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h.leads() {
			next.ServeHTTP(w, r)
			return
		}
		h.fromLeader(w, r)
	})
}

// fromLeader forwards a request to the Host leading the shared store and
// relays its answer.
func (h *Host) fromLeader(w http.ResponseWriter, r *http.Request) {
	m, ok, err := h.shared.Leader(r.Context())
	if err != nil || !ok || m.Address == "" || m.ID == h.shared.Me().ID { // this Host is taking over
		w.Header().Set("Retry-After", "1")
		proxy.WriteError(w, http.StatusServiceUnavailable, "ServiceUnavailableError",
			"no Host leads the shared store right now (one takes over within its lease); retry")
		return
	}
	scheme := "http"
	if h.serverTLS != nil {
		scheme = "https"
	}
	rp := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(&url.URL{Scheme: scheme, Host: m.Address})
			pr.Out.Header.Set("Via", "1.1 vhi-host-"+h.shared.Me().ID)
		},
		Transport:     h.forward,
		FlushInterval: -1, // a switched model's stream, event by event
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			proxy.WriteError(w, http.StatusBadGateway, "UpstreamError", "the leading Host at "+m.Address+" did not answer: "+err.Error())
		},
	}
	rp.ServeHTTP(w, r)
}

// leadership returns a channel closed once this Host leads: at once
// without a shared store; on one, after its campaign won — following the
// leader meanwhile — and this Host took over the leader's state (the
// records read back, a migration the last leader died in ended).
func (h *Host) leadership(ctx context.Context, wg *sync.WaitGroup) <-chan struct{} {
	led := make(chan struct{})
	if h.shared == nil {
		h.m.leader.Set(1)
		close(led)
		return led
	}
	wg.Go(func() { h.follow(ctx) })
	wg.Go(func() {
		for {
			err := h.shared.Campaign(ctx)
			if err == nil {
				break
			}
			if ctx.Err() != nil {
				return
			}
			if !errors.Is(err, store.ErrLeaseEnded) {
				h.log.Error("campaigning to lead the shared store failed; this Host only follows", zap.Error(err))
				return
			}
			// etcd stalled or was out of reach past the lease: a Host that
			// follows decided nothing, so it takes a new lease and goes on
			// (its clients' streams with it) instead of stopping.
			h.log.Warn("this Host's lease on the shared store ended while it followed; taking a new one", zap.Error(err))
			h.m.storeRejoins.Inc()
			for {
				err := h.shared.Rejoin(ctx)
				if err == nil {
					break
				}
				h.log.Warn("taking a new lease on the shared store failed; retrying", zap.Error(err))
				if !sleepCtx(ctx, time.Second) {
					return
				}
			}
		}
		h.takeOver()
		close(led)
	})
	return led
}

// takeOver makes this Host the one that decides: the records as the last
// leader left them, the migrations it left, then its drains and the
// switched models' states.
func (h *Host) takeOver() {
	if recs, err := h.shared.Instances(); err != nil {
		h.log.Warn("reading the instances' records at the takeover failed", zap.Error(err))
	} else {
		for _, rec := range recs {
			h.reg.Adopt(rec)
		}
		h.reg.SaveAll()
	}
	if err := h.mig.Restore(); err != nil {
		h.log.Warn("reading the migrations' records at the takeover failed", zap.Error(err))
	}
	h.tookOver.Store(true)
	h.m.leader.Set(1)
	// The Host before this one decided until now: the drains it left go on
	// from here, and the switched models' states are learned again.
	if ids := h.drainer.TakeOver(); len(ids) > 0 {
		h.log.Info("draining again the instances the last leader was draining", zap.Strings("drain_ids", ids))
	}
	if h.switcher != nil {
		h.switcher.Resync()
	}
	h.log.Info("this Host leads the shared store: it decides from here")
}

// whenLeading runs run(ctx) once led is closed, unless ctx ends first.
func whenLeading(ctx context.Context, led <-chan struct{}, run func(context.Context)) {
	select {
	case <-led:
		run(ctx)
	case <-ctx.Done():
	}
}

// sleepCtx waits d, or less if ctx ends first; it reports whether ctx is
// still alive.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

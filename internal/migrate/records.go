package migrate

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"go.uber.org/zap"
)

// record is what the Host's store keeps of a migration: its status, and
// what a restarted Host needs to clean up after it.
type record struct {
	hostapi.MigrationStatus
	// TargetReservations are the requests holding a reservation (or an
	// install not yet committed) on the target while the migration runs;
	// TargetEngine is where that engine's hooks are.
	TargetReservations []string `json:"target_reservations,omitempty"`
	TargetEngine       string   `json:"target_engine,omitempty"`
	// Moving are the requests the migration moves, and SourceEngine where
	// the source's hooks are: what the Host that takes over a migration
	// its Host left at or after the commit reconciles (settleAfterCommit).
	Moving       []string `json:"moving,omitempty"`
	SourceEngine string   `json:"source_engine,omitempty"`
}

// record returns a migration's record as the store keeps it.
func (o *Orchestrator) record(id string) (record, bool) {
	st, ok := o.Get(id)
	if !ok {
		return record{}, false
	}
	rec := record{MigrationStatus: st}
	o.mu.Lock()
	m := o.all[id]
	o.mu.Unlock()
	if m != nil && st.State == hostapi.StateRunning {
		m.mu.Lock()
		rec.TargetReservations = slices.Sorted(maps.Keys(m.reserved))
		m.mu.Unlock()
		rec.TargetEngine = m.dst.Engine.URL
		rec.Moving, rec.SourceEngine = m.ids(), m.src.Engine.URL
	}
	return rec, true
}

// RecordStore keeps migration records across Host restarts (the Host's
// store).
type RecordStore interface {
	PutMigration(id string, record json.RawMessage) error
	DeleteMigration(id string) error
	Migrations() (map[string]json.RawMessage, error)
}

// recorder writes migration records in the background: a write to disk
// (an fsync) must never sit inside a migration's pause, so steps only
// mark a record dirty and a writer catches up.
type recorder struct {
	store RecordStore
	o     *Orchestrator
	log   *zap.Logger

	mu      sync.Mutex
	dirty   map[string]bool
	forgot  map[string]bool
	wake    chan struct{}
	stop    chan struct{}
	stopped chan struct{}
}

func newRecorder(s RecordStore, o *Orchestrator, log *zap.Logger) *recorder {
	r := &recorder{store: s, o: o, log: log, dirty: map[string]bool{}, forgot: map[string]bool{},
		wake: make(chan struct{}, 1), stop: make(chan struct{}), stopped: make(chan struct{})}
	if s == nil {
		close(r.stopped)
		return r
	}
	go r.run()
	return r
}

// save marks a migration's record for writing; it never blocks.
func (r *recorder) save(id string) {
	if r.store == nil {
		return
	}
	r.mu.Lock()
	r.dirty[id] = true
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// forget removes a migration's record (the history bound dropped it).
func (r *recorder) forget(id string) {
	if r.store == nil {
		return
	}
	r.mu.Lock()
	delete(r.dirty, id)
	r.forgot[id] = true
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

func (r *recorder) run() {
	defer close(r.stopped)
	for {
		select {
		case <-r.wake:
			r.flush()
		case <-r.stop:
			r.flush()
			return
		}
	}
}

func (r *recorder) flush() {
	r.mu.Lock()
	dirty, forgot := r.dirty, r.forgot
	r.dirty, r.forgot = map[string]bool{}, map[string]bool{}
	r.mu.Unlock()
	for id := range dirty {
		rec, ok := r.o.record(id)
		if !ok {
			continue
		}
		b, err := json.Marshal(rec)
		if err == nil {
			err = r.store.PutMigration(id, b)
		}
		if err != nil {
			r.log.Error("saving a migration record failed", zap.String("migration_id", id), zap.Error(err))
		}
	}
	for id := range forgot {
		if err := r.store.DeleteMigration(id); err != nil {
			r.log.Error("deleting a migration record failed", zap.String("migration_id", id), zap.Error(err))
		}
	}
}

// close writes what is still dirty and stops the writer.
func (r *recorder) close() {
	if r.store == nil {
		return
	}
	select {
	case <-r.stopped:
	default:
		close(r.stop)
		<-r.stopped
	}
}

// restore loads the records of earlier Hosts. A migration that was
// running when its Host stopped is over: before the commit, the source's
// pause lease resumed it, and the target's reservations are released now
// (releaseLeftReservations), not at the end of their lease; after it, the
// target runs the requests but their clients' streams ended with that
// Host.
func (o *Orchestrator) restore() error {
	if o.rec.store == nil {
		return nil
	}
	recs, err := o.rec.store.Migrations()
	if err != nil {
		return err
	}
	now := time.Now().UTC()
	var list []hostapi.MigrationStatus
	for id, raw := range recs {
		var rec record
		if err := json.Unmarshal(raw, &rec); err != nil || rec.ID != id {
			o.log.Warn("skipping an unreadable migration record", zap.String("migration_id", id))
			continue
		}
		st := rec.MigrationStatus
		if st.State == hostapi.StateRunning {
			if len(rec.TargetReservations) > 0 && rec.TargetEngine != "" {
				o.wg.Add(1)
				go o.releaseLeftReservations(rec)
			}
			at := st.CurrentStep
			if (st.Committed || at == string(stepCommit)) && len(rec.Moving) > 0 && rec.TargetEngine != "" && rec.SourceEngine != "" {
				o.wg.Add(1)
				go o.settleAfterCommit(rec)
			}
			switch {
			case st.Committed:
				st.State = hostapi.StateFailed
				st.Error = "the Host stopped after the commit (at step " + at + "): the target runs the moved requests; the streams relayed by that Host ended with it"
			case at == string(stepCommit):
				st.State = hostapi.StateFailed
				st.Error = "the Host stopped during the commit: the target may run the moved requests as well as the source; the streams relayed by that Host ended with it"
			default:
				st.State = hostapi.StateAborted
				st.Error = "the Host stopped during the migration (at step " + at + "); the engines' leases rolled it back"
				if len(rec.TargetReservations) > 0 {
					st.Error = "the Host stopped during the migration (at step " + at + "); the source's pause lease resumed it, and the restarted Host released the target's reservations"
				}
			}
			st.CurrentStep, st.FinishedAt = string(stepDone), now
		}
		list = append(list, st)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].CreatedAt.Before(list[j].CreatedAt) })
	for _, st := range list {
		m := &migration{o: o, st: st}
		o.add(m)
		o.rec.save(st.ID)
	}
	return nil
}

// releaseLeftReservations releases, on the target of a migration that was
// running when an earlier Host stopped, what that migration reserved
// there — at once, retrying while the engine does not answer (it may be
// starting again too), until the reservations' own lease would have.
// Only reservations and uncommitted installs go: a request the commit
// made running there stays (hooks.AbortRequest.ReservedOnly).
func (o *Orchestrator) releaseLeftReservations(rec record) {
	defer o.wg.Done()
	log := o.log.With(zap.String("migration_id", rec.ID), zap.String("target", rec.Dst))
	until := rec.CreatedAt.Add(o.cfg.ReservationLease)
	if d := time.Now().Add(o.cfg.RPCTimeout); until.Before(d) {
		until = d // a clock step, or a lease already over: try once
	}
	for {
		ctx, cancel := context.WithTimeout(o.ctx, o.cfg.RPCTimeout)
		n, err := o.releaseDirectly(ctx, rec.TargetEngine, rec.TargetReservations)
		cancel()
		if err == nil {
			log.Info("released the target's reservations of a migration an earlier Host left", zap.Int("released", n))
			return
		}
		if time.Now().After(until) {
			log.Warn("could not release the target's reservations of a migration an earlier Host left (their lease has)", zap.Error(err))
			return
		}
		select {
		case <-o.ctx.Done():
			return
		case <-time.After(250 * time.Millisecond):
		}
	}
}

package migrate

import (
	"encoding/json"
	"sort"
	"sync"
	"time"

	"github.com/vllm-hi/vllm-hi/api/hostapi"

	"go.uber.org/zap"
)

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
		st, ok := r.o.Get(id)
		if !ok {
			continue
		}
		b, err := json.Marshal(st)
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
// running when its Host stopped is over: before the commit, the engines'
// leases rolled it back (the source resumed, the target freed its blocks);
// after it, the target runs the requests but their clients' streams ended
// with that Host.
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
		var st hostapi.MigrationStatus
		if err := json.Unmarshal(raw, &st); err != nil || st.ID != id {
			o.log.Warn("skipping an unreadable migration record", zap.String("migration_id", id))
			continue
		}
		if st.State == hostapi.StateRunning {
			at := st.CurrentStep
			switch {
			case st.Committed:
				st.State = hostapi.StateFailed
				st.Error = "the Host stopped after the commit (at step " + at + "): the target runs the moved requests, but their clients' streams ended with that Host"
			case at == string(stepCommit):
				st.State = hostapi.StateFailed
				st.Error = "the Host stopped during the commit: the target may run the moved requests as well as the source; their clients' streams ended with that Host"
			default:
				st.State = hostapi.StateAborted
				st.Error = "the Host stopped during the migration (at step " + at + "); the engines' leases rolled it back"
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

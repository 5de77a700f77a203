package migrate

import (
	"context"
	"fmt"

	"go.uber.org/zap"
)

// settleAfterCommit reconciles, on the Host that took over, a migration
// its Host left at or after the commit. Both engines may then run a moved
// request: the source resumed it when its pause lease ended, and the
// target runs it if the commit reached it. Each such request keeps the
// copy a client's stream reads — on any live Host, which relays it from
// the source, or from the target where the switch had reached it — and
// loses the other; a request no live Host relays (its client was the dead
// Host's) loses both, so that no engine decodes for nobody.
//
// The leader's switch notice to the other Hosts lives under its store
// lease, which ended before this Host could lead: every switch it caused
// has happened by now, so what the Hosts relay is settled.
func (o *Orchestrator) settleAfterCommit(rec record) {
	defer o.wg.Done()
	log := o.log.With(zap.String("migration_id", rec.ID))
	ctx, cancel := context.WithTimeout(o.ctx, o.cfg.PauseCallTimeout+2*o.cfg.RPCTimeout)
	defer cancel()
	reading := o.readers(ctx, rec.ID, rec.Moving)
	var dropSrc, dropDst []string
	onSrc, onDst := 0, 0
	for _, id := range rec.Moving {
		switch reading[id] {
		case rec.Src:
			onSrc++
			dropDst = append(dropDst, id)
		case rec.Dst:
			onDst++
			dropSrc = append(dropSrc, id)
		default:
			dropSrc, dropDst = append(dropSrc, id), append(dropDst, id)
		}
	}
	nDst, errDst := o.abortDirectly(ctx, rec.TargetEngine, dropDst, false)
	nSrc, errSrc := o.abortDirectly(ctx, rec.SourceEngine, dropSrc, false)
	note := fmt.Sprintf("; the Host that took over left %d moved streams on the source and %d on the target, where live Hosts' clients read them, and aborted the copies no client reads: %d on the target, %d on the source",
		onSrc, onDst, nDst, nSrc)
	if errDst != nil || errSrc != nil {
		note += fmt.Sprintf(" (not all: target %v, source %v; those end when their requests do)", errDst, errSrc)
	}
	log.Info("settled a migration an earlier Host left after its commit", zap.Int("on_source", onSrc), zap.Int("on_target", onDst),
		zap.Int("aborted_on_target", nDst), zap.Int("aborted_on_source", nSrc), zap.NamedError("target_error", errDst), zap.NamedError("source_error", errSrc))
	o.mu.Lock()
	m := o.all[rec.ID]
	o.mu.Unlock()
	if m != nil {
		m.mu.Lock()
		m.st.Error += note
		m.mu.Unlock()
		o.rec.save(rec.ID)
	}
}

// readers says, of the requests ids, which instance each live client's
// stream reads from: this Host's streams, and those the other Hosts
// answer a census for (a request none relays is absent).
func (o *Orchestrator) readers(ctx context.Context, migration string, ids []string) map[string]string {
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	out := map[string]string{}
	for instance, rids := range o.streams.IDsByInstance() {
		for _, id := range rids {
			if want[id] {
				out[id] = instance
			}
		}
	}
	o.mu.Lock()
	relays := o.relays
	o.mu.Unlock()
	if relays != nil {
		cctx, cancel := context.WithTimeout(ctx, o.cfg.PauseCallTimeout)
		defer cancel()
		for id, s := range relays.Census(cctx, migration, ids) {
			if s.Instance != "" {
				out[id] = s.Instance
			}
		}
	}
	return out
}

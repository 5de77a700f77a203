package migrate

import "context"

// WarmCopies are the Host's warm standby copies (failover.Manager): a
// target may hold a reservation of a moving request already, a copy of
// its KV kept for a failover, which a migration's own reservation there
// would collide with.
type WarmCopies interface {
	// ReleaseCopies frees the copies of ids that instance holds.
	ReleaseCopies(ctx context.Context, instance string, ids []string)
}

// SetWarmCopies makes migrations release the warm copies their targets
// hold of the requests they move, before reserving them there.
func (o *Orchestrator) SetWarmCopies(w WarmCopies) {
	o.mu.Lock()
	o.warm = w
	o.mu.Unlock()
}

// releaseWarmCopies frees the target's warm copies of the items' requests.
func (m *migration) releaseWarmCopies(ctx context.Context, ids []string) {
	m.o.mu.Lock()
	w := m.o.warm
	m.o.mu.Unlock()
	if w != nil && len(ids) > 0 {
		w.ReleaseCopies(ctx, m.dst.ID, ids)
	}
}

package sim

// A step in flight, as vLLM's forward pass runs beside its scheduler.
//
// Run schedules a step under mu, releases mu for its compute (the KV
// writes, then the hashes its tokens are drawn from) and takes mu again
// to commit it. Whoever must see the engine between steps calls lock(),
// which waits for the commit; that is every caller but these, which take
// mu during the compute because nothing they read changes before the
// commit:
//   - Changes, Requests, Stats and Layout: the write log, the request list
//     and the counts move only at the commit (the step's writes are
//     stamped then);
//   - Export of paused requests: a paused request's state does not move
//     while it is paused;
//   - Pause with DropInFlight: it pauses once the step's KV writes have
//     landed, and the commit keeps nothing of that step for the paused
//     requests (their position is computed again by whoever continues
//     them, to the same bytes: the sim's KV depends on the token and its
//     position only), so the pause no longer waits for the rest of the
//     step — the hashes and the tokens — as vLLM's drop does not wait for
//     the forward pass. A copy or a check after it reads blocks that no
//     write of the dropped step still changes.
//
// The compute reads only the batch's block tables and positions, which no
// caller of the list above changes, and nothing frees a block while the
// step is in flight (every freeing caller waits in lock()).

// lock takes mu at a step boundary.
func (e *Engine) lock() {
	e.mu.Lock()
	e.awaitBoundary(func() bool { return !e.inFlight })
}

// lockForPause takes mu where a pause may land: at a boundary, or with
// drop once the step in flight has written its KV.
func (e *Engine) lockForPause(drop bool) {
	e.mu.Lock()
	e.awaitBoundary(func() bool { return !e.inFlight || (drop && e.writesLanded) })
}

// awaitBoundary waits (mu held) until ok. While anyone waits, Run does not
// start its next step (see waitersServed): where the sim's compute outlasts
// its modelled step, Run takes mu again the moment it commits, and a caller
// woken at that boundary would otherwise find the next step in flight,
// every time.
func (e *Engine) awaitBoundary(ok func() bool) {
	if ok() {
		return
	}
	e.boundaryWaiters++
	for !ok() {
		e.boundary.Wait()
	}
	e.boundaryWaiters--
	if e.boundaryWaiters == 0 {
		e.boundary.Broadcast() // Run may go on
	}
}

// waitersServed lets every caller waiting for the boundary in before Run
// starts another step (mu held).
func (e *Engine) waitersServed() {
	for e.boundaryWaiters > 0 {
		e.boundary.Wait()
	}
}

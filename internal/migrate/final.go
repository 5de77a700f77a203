package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
)

// committed is what the commit hands on to the switch.
type committed struct {
	states    []movedState // the requests the target now runs
	paused    []string     // what the pause paused on the source
	pauseCall time.Time
}

// moved are the committed requests' ids.
func (c committed) moved() []string {
	out := make([]string, len(c.states))
	for i, st := range c.states {
		out[i] = st.RequestID
	}
	return out
}

// final pauses the source and, while it is paused, copies the last delta
// and moves the scheduler state side by side: the target installs the
// state paused while the copy runs. The Host then checks that the target
// holds what the source held, and commits by resuming the target —
// ownership flips there — but only while the source's pause lease is
// certain to hold: a source that resumes by itself while the target runs
// would produce every token twice.
func (m *migration) final(ctx context.Context, since uint64) (committed, error) {
	var c committed
	if err := m.enter(ctx, stepPause); err != nil {
		return c, err
	}
	m.phase.Store(phasePaused) // the clients wait from here: the heartbeat's shorter limit
	c.pauseCall = time.Now()
	c.paused = m.ids()
	wait, err := m.pauseSource(ctx, since)
	if err != nil {
		return c, err
	}
	// The requests kept decoding, and their clients kept receiving tokens,
	// until the step in flight ended: the downtime starts there.
	stopped := c.pauseCall.Add(wait)
	// The fence: the source's lease counts from when it applied the pause,
	// after this call was sent, so committing before pauseCall + lease −
	// margin lands while the source is certainly still paused.
	fence := c.pauseCall.Add(m.o.cfg.PauseLease - margin(m.o.cfg.PauseLease))
	if fence.After(m.deadline) {
		fence = m.deadline
	}
	fctx, cancel := context.WithDeadline(ctx, fence)
	defer cancel()
	// Test of the Host dying while the source is paused: the source's
	// pause lease and the target's reservation lease must clean up.
	m.crashIf("crash_after_pause", "with the source paused")

	if err := m.enter(fctx, stepFinal); err != nil {
		return c, m.late(fctx, err)
	}
	if len(m.ids()) > 0 {
		if c.states, err = m.finalRound(fctx, since); err != nil {
			return c, m.late(fctx, err)
		}
	}
	if m.o.cfg.Verify != hostapi.VerifyOff {
		if err := m.enter(fctx, stepVerify); err != nil {
			return c, m.late(fctx, err)
		}
	}
	if err := m.verify(fctx, c.states); err != nil {
		return c, m.late(fctx, err)
	}
	// A paused request can still end in the pause (its client left); the
	// check leaves it behind.
	if c.states, err = m.stillMoving(fctx, c.states, "that ended during the check"); err != nil {
		return c, m.late(fctx, err)
	}
	if err := m.enter(fctx, stepCommit); err != nil {
		return c, m.late(fctx, err)
	}
	m.phase.Store(phaseCommitting) // no rollback from here: the heartbeat stops
	moved := c.moved()
	if len(moved) > 0 {
		if time.Now().After(fence) {
			return c, fmt.Errorf("the commit would come after the source's pause lease (%v) could end; rolled back instead", m.o.cfg.PauseLease)
		}
		rctx, rcancel := m.pausedCall(fctx)
		_, err := m.dstA.Engine.Resume(rctx, hooks.ResumeRequest{RequestIDs: moved})
		err = m.slowPausedCall(fctx, rctx, err)
		rcancel()
		if err != nil {
			// Whether or not the target resumed, its copies are aborted
			// with the reservations and the source resumes: no client was
			// switched yet, so nothing the target produced was seen.
			return c, m.late(fctx, fmt.Errorf("commit on the target: %w", err))
		}
	}
	// Ownership has flipped: the target runs the requests.
	downtime := time.Since(stopped)
	m.mu.Lock()
	for _, id := range moved {
		delete(m.reserved, id)
	}
	m.st.Committed = true
	m.st.DowntimeS = downtime.Seconds()
	m.st.PauseWaitS = wait.Seconds()
	m.st.Migrated = len(c.states)
	m.mu.Unlock()
	return c, nil
}

// late turns an error caused by the fence's deadline into one that says so.
func (m *migration) late(ctx context.Context, err error) error {
	if ctx.Err() == context.DeadlineExceeded {
		return fmt.Errorf("%w (the final phase must commit within the source's pause lease, %v, and the migration's deadline)", err, m.o.cfg.PauseLease)
	}
	return err
}

// finalRound copies the last delta while the state moves: the source's
// export goes to the target untouched and the target installs it paused,
// both while the copy runs. It returns the moved requests' states once
// both are done. A request the copy dropped (its client left meanwhile)
// is taken off the target again.
func (m *migration) finalRound(ctx context.Context, since uint64) ([]movedState, error) {
	fault := m.req.InjectFault
	if fault == "crash_after_pause" || fault == "target_full" {
		fault = "" // not data-plane faults
	}
	if f := transfer.ParseFault(fault); f == transfer.CorruptFrame || f == transfer.CutConn {
		// A fault the data plane notices needs bytes in flight: the final
		// round then copies everything the source wrote, not only what it
		// wrote since the last round, which is nothing where the pause
		// landed at the step boundary that round read (a test of the
		// abort path then saw the migration succeed). Not for a silent
		// corruption, which the check must find in what the final round
		// moves as usual. Only with fault injection on.
		since = 0
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	type copyResult struct {
		err error
		// interrupted: the copy failed because its context ended (the
		// state move failed and cancelled it, or the fence passed).
		interrupted bool
	}
	copied := make(chan copyResult, 1)
	go func() {
		_, err := m.copyRound(cctx, roundFinal, since, m.req.FinalGranularity != "block", fault)
		copied <- copyResult{err, err != nil && cctx.Err() != nil}
	}()
	states, err := m.moveState(ctx)
	if err != nil {
		cancel()
	}
	// Never return with the copy still writing into the target: a rollback
	// frees those blocks. The error to report is the one that came first:
	// a copy that failed by itself, else the state move's (a failed state
	// move cancels the copy).
	c := <-copied
	switch {
	case c.err != nil && !c.interrupted:
		return nil, c.err
	case err != nil:
		return nil, err
	case c.err != nil:
		return nil, c.err
	}
	return m.stillMoving(ctx, states, "the copy dropped")
}

// stillMoving keeps the states of the requests still moving and takes
// the others (dropped by the copy, or ended during the check: why) off
// the target again.
func (m *migration) stillMoving(ctx context.Context, states []movedState, why string) ([]movedState, error) {
	moving := map[string]bool{}
	for _, id := range m.ids() {
		moving[id] = true
	}
	kept, gone := states[:0:0], []string(nil)
	for _, st := range states {
		if moving[st.RequestID] {
			kept = append(kept, st)
		} else {
			gone = append(gone, st.RequestID)
		}
	}
	if len(gone) > 0 {
		actx, acancel := m.pausedCall(ctx)
		defer acancel()
		if _, err := m.dstA.Engine.Abort(actx, hooks.AbortRequest{RequestIDs: gone, Silent: true, IgnoreMissing: true}); err != nil {
			return nil, fmt.Errorf("take requests %s off the target: %w", why, err)
		}
	}
	return kept, nil
}

// moveState exports the paused requests' state from the source and installs
// it, paused, on the target, in a few chunks side by side: encoding and
// decoding 256 requests' token ids and text is the longest part of the
// final round, and engines handle hook calls concurrently.
func (m *migration) moveState(ctx context.Context) ([]movedState, error) {
	// What the pause exported already only needs installing, in chunks
	// side by side; the rest (an engine that does not export with its
	// pause) is exported chunk by chunk.
	parts, rest, err := splitExport(m.pauseExported, m.ids())
	if err != nil {
		return nil, fmt.Errorf("export the source's state (with its pause): %w", err)
	}
	var chunks [][]string
	if len(rest) > 0 {
		chunks = stateChunks(rest)
	}
	out := make([][]movedState, len(parts)+len(chunks))
	errs := make([]error, len(out))
	// The only install is the pause's last: the target wakes the streams
	// pre-attached to it at once (several side by side, it waits until
	// they stop coming).
	last := len(out) == 1
	sideBySide(len(out), func(i int) {
		if i < len(parts) {
			out[i], errs[i] = m.installChunk(ctx, parts[i].ids, parts[i].raw, time.Now(), time.Now(), last)
			return
		}
		out[i], errs[i] = m.moveChunk(ctx, chunks[i-len(parts)], last)
	})
	var all []movedState
	for i := range out {
		if errs[i] != nil {
			return nil, errs[i]
		}
		all = append(all, out[i]...)
	}
	return all, nil
}

// exportPart is a chunk of an export: its requests' ids and the export
// answer ({"cursor":…,"requests":[…]}) of them alone.
type exportPart struct {
	ids []string
	raw []byte
}

// splitExport splits the pause's export of the moving requests ids (nil:
// none) into installs of up to maxInstallChunkBytes, and returns the ids
// it did not carry.
func splitExport(raw json.RawMessage, ids []string) (parts []exportPart, rest []string, err error) {
	if len(raw) == 0 {
		return nil, ids, nil
	}
	var exp struct {
		Cursor   json.RawMessage   `json:"cursor"`
		Requests []json.RawMessage `json:"requests"`
	}
	if err := json.Unmarshal(raw, &exp); err != nil {
		return nil, nil, fmt.Errorf("unreadable answer: %v", err)
	}
	if len(exp.Cursor) == 0 {
		return nil, nil, fmt.Errorf("an answer without its cursor")
	}
	moving := map[string]bool{}
	for _, id := range ids {
		moving[id] = true
	}
	var carried []string
	byID := map[string]json.RawMessage{}
	for _, r := range exp.Requests {
		var head struct {
			RequestID string `json:"request_id"`
		}
		if err := json.Unmarshal(r, &head); err != nil {
			return nil, nil, fmt.Errorf("unreadable request: %v", err)
		}
		// A request the Host no longer moves (it ended) stays behind.
		if moving[head.RequestID] && byID[head.RequestID] == nil {
			byID[head.RequestID] = r
			carried = append(carried, head.RequestID)
		}
	}
	for _, id := range ids {
		if byID[id] == nil {
			rest = append(rest, id)
		}
	}
	if len(carried) == 0 {
		return nil, rest, nil
	}
	head := append(append([]byte(`{"cursor":`), exp.Cursor...), `,"requests":[`...)
	var part exportPart
	for _, id := range carried {
		if len(part.ids) > 0 && len(part.raw)+len(byID[id]) > maxInstallChunkBytes {
			parts = append(parts, exportPart{ids: part.ids, raw: append(part.raw, "]}"...)})
			part = exportPart{}
		}
		if len(part.ids) == 0 {
			part.raw = append([]byte(nil), head...)
		} else {
			part.raw = append(part.raw, ',')
		}
		part.ids = append(part.ids, id)
		part.raw = append(part.raw, byID[id]...)
	}
	parts = append(parts, exportPart{ids: part.ids, raw: append(part.raw, "]}"...)})
	return parts, rest, nil
}

// maxInstallChunkBytes bounds one install of what the pause exported. The
// pause exports the tokens since the stage alone (~200 bytes a request),
// so a migration's whole export is usually one install: each install
// costs the target's API server ~3 ms of HTTP whatever its size, and the
// eight installs of 32 such tails it answered one after another made the
// final round's longest part (7 → 31 ms on the H100, 2026-12-06; their
// own work ~0.5 ms each).
const maxInstallChunkBytes = 512 << 10

// State moves in up to maxStateChunks chunks of at least minStateChunk
// requests.
const (
	maxStateChunks = 8
	minStateChunk  = 16
)

// stateChunks splits ids into the chunks their state moves in.
func stateChunks(ids []string) [][]string {
	n := max(1, min(maxStateChunks, (len(ids)+minStateChunk-1)/minStateChunk))
	out := make([][]string, n)
	for i := range n {
		out[i] = ids[i*len(ids)/n : (i+1)*len(ids)/n]
	}
	return out
}

// sideBySide runs fn(0) … fn(n-1) concurrently and waits for them all
// (one runs on the caller's goroutine).
func sideBySide(n int, fn func(i int)) {
	if n == 1 {
		fn(0)
		return
	}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(i)
		}()
	}
	wg.Wait()
}

// moveChunk exports some paused requests and installs them on the target.
// The export goes on as it came: the target installs into the blocks it
// reserved per request id, so nothing in it needs rewriting. The Host
// reads only what splicing and the end-to-end check need, while the
// target installs.
func (m *migration) moveChunk(ctx context.Context, ids []string, last bool) ([]movedState, error) {
	var raw []byte
	start := time.Now()
	for attempt := 0; ; attempt++ {
		if len(ids) == 0 {
			return nil, nil
		}
		b, _ := json.Marshal(hooks.ExportRequest{RequestIDs: ids, OutputFrom: m.stagedOutputs(ids)})
		ectx, ecancel := m.pausedCall(ctx)
		var err error
		raw, err = m.srcA.Engine.Raw(ectx, hooks.HookExport, b)
		err = m.slowPausedCall(ctx, ectx, err)
		ecancel()
		if err == nil {
			break
		}
		if !errdefs.IsNotFound(err) || attempt > 3 {
			return nil, fmt.Errorf("export the source's state: %w", err)
		}
		// A client left after the pause: its request is gone from the source.
		if ids, err = m.liveOnSource(ctx, ids); err != nil {
			return nil, fmt.Errorf("export the source's state: %w", err)
		}
	}
	return m.installChunk(ctx, ids, raw, start, time.Now(), last)
}

// installChunk installs the exported requests ids (raw: the export's
// answer for them, exported from start until exported) on the target,
// paused, and returns what the Host reads of their states. last: the
// pause's last install (hooks.InstallRequest.Last).
func (m *migration) installChunk(ctx context.Context, ids []string, raw []byte, start, exported time.Time, last bool) ([]movedState, error) {
	if len(raw) < 2 || raw[0] != '{' {
		return nil, fmt.Errorf("export the source's state: unreadable answer")
	}
	// {"cursor":…,"requests":[…]} → {"resume":false,"lease_ms":…,"last":…,"text_from":{…},"ids_from":{…},"cursor":…,"requests":[…]}
	head := fmt.Sprintf(`{"resume":false,"lease_ms":%d,`, m.o.cfg.PauseLease/time.Millisecond)
	if last {
		head += `"last":true,`
	}
	if at, n := m.hold(ids); len(at) > 0 {
		b, _ := json.Marshal(at)
		head += `"text_from":` + string(b) + `,`
		if len(n) > 0 {
			// The output token ids each held client got: the pre-attached
			// stream's first event carries the ids after them, so that a
			// client that asked for ids (and the relay, which tracks them
			// for failover) has every token's id once.
			b, _ = json.Marshal(n)
			head += `"ids_from":` + string(b) + `,`
		}
	}
	install := append([]byte(head), raw[1:]...)
	type installResult struct {
		raw []byte
		err error
	}
	installed := make(chan installResult, 1)
	go func() {
		ictx, icancel := m.pausedCall(ctx)
		defer icancel()
		out, err := m.dstA.Engine.Raw(ictx, hooks.HookInstall, install)
		installed <- installResult{out, m.slowPausedCall(ctx, ictx, err)}
	}()
	var exp struct {
		Requests []movedState `json:"requests"`
	}
	perr := json.Unmarshal(raw, &exp)
	res := <-installed
	m.log.Debug("state moved", zap.Int("requests", len(ids)), zap.Int("export_bytes", len(raw)),
		zap.Duration("export", exported.Sub(start)), zap.Duration("install", time.Since(exported)))
	if res.err != nil {
		return nil, fmt.Errorf("install on the target: %w", res.err)
	}
	if perr != nil {
		return nil, fmt.Errorf("export the source's state: unreadable answer: %v", perr)
	}
	var ans hooks.InstallResponse
	if err := json.Unmarshal(res.raw, &ans); err != nil {
		return nil, fmt.Errorf("install on the target: unreadable answer: %v", err)
	}
	for i := range exp.Requests {
		st := &exp.Requests[i]
		st.visible, st.armed = -1, -1
		if v, ok := ans.VisibleText[st.RequestID]; ok {
			st.visible = v
		}
		if a, ok := ans.TextFrom[st.RequestID]; ok {
			st.armed = a
		}
		if src := sourceVisibleText(*st); st.visible >= 0 && src >= 0 && src != st.visible {
			// Both engines derived the moved tokens' text, and they
			// disagree: the client's text would not read as one stream.
			m.log.Warn("the target's text for the moved tokens differs from the source's",
				zap.String("request_id", st.RequestID), zap.Int("source_code_points", src),
				zap.Int("target_code_points", st.visible), zap.Int("tokens", st.outputs()))
		}
	}
	return exp.Requests, nil
}

// movedState is the part of an exported request the Host reads.
type movedState struct {
	RequestID      string        `json:"request_id"`
	OutputTokenIDs hooks.IntList `json:"output_token_ids"`
	// OutputFrom: the export carried only the output tokens after these
	// (the target's stage holds them; hooks.ExportRequest.OutputFrom).
	OutputFrom        int           `json:"output_from"`
	TextOffsets       hooks.IntList `json:"text_offsets"`
	NumComputedTokens int           `json:"num_computed_tokens"`
	// visible is the text the target's install said the client had got
	// (hooks.InstallResponse.VisibleText); -1 when it said nothing.
	visible int
	// armed is where the target's pre-attached stream opens
	// (hooks.InstallResponse.TextFrom); -1: not armed.
	armed int
}

// outputs is how many output tokens the request had when it was exported.
func (st movedState) outputs() int { return st.OutputFrom + len(st.OutputTokenIDs) }

// visibleText is how much text (code points) the source's client stream
// carries once every exported output token went out: as the target's
// install derived it, else as the source's export said.
func visibleText(st movedState) int {
	if st.visible >= 0 {
		return st.visible
	}
	return sourceVisibleText(st)
}

// sourceVisibleText is visibleText as the source's export said it; -1
// when it said nothing usable.
func sourceVisibleText(st movedState) int {
	if st.OutputFrom > 0 || len(st.TextOffsets) != len(st.OutputTokenIDs) {
		return -1
	}
	if len(st.TextOffsets) == 0 {
		return 0
	}
	return st.TextOffsets[len(st.TextOffsets)-1]
}

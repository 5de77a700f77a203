package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	v1 "github.com/vllm-hi/vllm-hi/api/vllmhi/v1"
	"github.com/vllm-hi/vllm-hi/internal/host/registry"
	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// final pauses the source and, while it is paused, copies the last delta
// and moves the scheduler state side by side: the target installs the
// state paused while the copy runs. The Host then checks that the target
// holds what the source held, and commits by resuming the target —
// ownership flips there — but only while the source's pause lease is
// certain to hold: a source that resumes by itself while the target runs
// would produce every token twice. Then the streams switch.
func (m *migration) final(ctx context.Context, since uint64) {
	m.step(stepPause)
	pauseCall := time.Now()
	paused := m.ids()
	wait, ok := m.pauseSource(ctx)
	if !ok {
		return
	}
	// The requests kept decoding, and their clients kept receiving tokens,
	// until the step in flight ended: the downtime starts there.
	stopped := pauseCall.Add(wait)
	// The fence: the source's lease counts from when it applied the pause,
	// after this call was sent, so committing before pauseCall + lease −
	// margin lands while the source is certainly still paused.
	fence := pauseCall.Add(m.o.cfg.PauseLease - margin(m.o.cfg.PauseLease))
	if fence.After(m.deadline) {
		fence = m.deadline
	}
	fctx, cancel := context.WithDeadline(ctx, fence)
	defer cancel()
	if m.req.InjectFault == "crash_after_pause" {
		// Test of the Host dying while the source is paused: the source's
		// pause lease and the target's reservation lease must clean up.
		m.log.Error("injected fault: the Host exits with the source paused")
		os.Exit(3)
	}

	m.step(stepFinal)
	var states []movedState
	if len(m.ids()) > 0 {
		var err error
		if states, err = m.finalRound(fctx, since); err != nil {
			m.fail(m.late(fctx, err))
			return
		}
	}
	if m.o.cfg.Verify != hostapi.VerifyOff {
		m.step(stepVerify)
	}
	if err := m.verify(fctx, states); err != nil {
		m.o.met.integrity(err)
		m.fail(m.late(fctx, err))
		return
	}
	m.step(stepCommit)
	moved := make([]string, len(states))
	for i, st := range states {
		moved[i] = st.RequestID
	}
	if len(moved) > 0 {
		if time.Now().After(fence) {
			m.fail(fmt.Errorf("the commit would come after the source's pause lease (%v) could end; rolled back instead", m.o.cfg.PauseLease))
			return
		}
		if _, err := hook[hooks.ResumeResponse](fctx, m.dstA, "resume", hooks.ResumeRequest{RequestIDs: moved}, 0); err != nil {
			// Whether or not the target resumed, its copies are aborted
			// with the reservations and the source resumes: no client was
			// switched yet, so nothing the target produced was seen.
			m.fail(m.late(fctx, fmt.Errorf("commit on the target: %w", rpcError(err))))
			return
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
	m.st.Migrated = len(states)
	m.mu.Unlock()
	m.applyRoles()

	m.step(stepSwitch)
	spliced, failed, firstErr := m.switchStreams(states)
	// Drop the source's copies (a spliced stream already closed its
	// source connection, which aborted some of them).
	actx, acancel := context.WithTimeout(context.Background(), m.o.cfg.RPCTimeout)
	if len(moved) > 0 {
		if _, err := hook[hooks.AbortResponse](actx, m.srcA, "abort", hooks.AbortRequest{RequestIDs: moved, Silent: true, IgnoreMissing: true}, 0); err != nil {
			m.log.Warn("dropping the source's copies failed (their pause lease will resume them, and the Host's relay drops their tokens)", zap.Error(err))
		}
	}
	m.resumeLeftBehind(actx, paused, moved)
	acancel()
	m.pausedSrc = false

	m.step(stepApply)
	m.applyType()
	m.measureClientGap(spliced, pauseCall)
	if len(failed) > 0 {
		m.finish(hostapi.StateFailed, fmt.Sprintf("the target runs the moved requests, but %d of %d streams could not switch to it (their clients got an error event): %v",
			len(failed), len(states), firstErr))
	} else {
		m.finish(hostapi.StateSucceeded, "")
	}
	m.closeTarget()
}

// late turns an error caused by the fence's deadline into one that says so.
func (m *migration) late(ctx context.Context, err error) error {
	if ctx.Err() == context.DeadlineExceeded {
		return fmt.Errorf("%w (the final phase must commit within the source's pause lease, %v, and the migration's deadline)", err, m.o.cfg.PauseLease)
	}
	return err
}

// switchStreams splices each moved stream onto the target and waits (up
// to the splice timeout) for every one to switch. Requests nobody listens
// to any more are aborted on the target.
func (m *migration) switchStreams(states []movedState) (spliced []*proxy.Stream, failed []string, firstErr error) {
	var waits []<-chan error
	var orphans []string
	for _, st := range states {
		s := m.o.streams.Get(st.RequestID)
		if s == nil {
			orphans = append(orphans, st.RequestID) // the client left meanwhile
			continue
		}
		spliced = append(spliced, s)
		waits = append(waits, s.Splice(m.dst.Engine.URL, m.dst.ID, len(st.OutputTokenIDs), visibleText(st)))
	}
	timeout := time.After(m.o.cfg.SpliceTimeout)
wait:
	for i, w := range waits {
		select {
		case err := <-w:
			if err != nil {
				m.log.Warn("a stream could not move", zap.String("request_id", spliced[i].ID), zap.Error(err))
				failed = append(failed, spliced[i].ID)
				if firstErr == nil {
					firstErr = err
				}
			}
		case <-timeout:
			// Their clients read slowly: the relay switches each once it
			// has written everything the source produced.
			m.log.Warn("streams still moving at the splice timeout", zap.Int("streams", len(waits)-i))
			break wait
		}
	}
	// A stream that could not switch has no client on the target: its
	// request there only holds blocks.
	orphans = append(orphans, failed...)
	if len(orphans) > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), m.o.cfg.RPCTimeout)
		_, _ = hook[hooks.AbortResponse](ctx, m.dstA, "abort", hooks.AbortRequest{RequestIDs: orphans, Silent: true, IgnoreMissing: true}, 0)
		cancel()
	}
	return spliced, failed, firstErr
}

// measureClientGap records the longest gap a moved stream's client saw
// across the switch, from its last token from the source to its first
// event from the target.
func (m *migration) measureClientGap(spliced []*proxy.Stream, pauseStart time.Time) {
	deadline := time.Now().Add(2 * time.Second)
	var worst time.Duration
	for _, s := range spliced {
		for {
			last, first := s.SwitchGap()
			if last.IsZero() {
				last = pauseStart // no token from the source yet
			}
			if !first.IsZero() {
				worst = max(worst, first.Sub(last))
				break
			}
			if time.Now().After(deadline) {
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	m.mu.Lock()
	m.st.ClientDowntimeS = worst.Seconds()
	m.mu.Unlock()
}

// applyRoles flips the roles as the migration type says, right after the
// commit (a Host that dies from here on restarts with them).
func (m *migration) applyRoles() {
	reg := m.o.reg
	switch m.req.Type {
	case hostapi.DestroySource:
		_ = reg.SetRole(m.dst.ID, registry.RoleActive)
		_ = reg.SetRole(m.src.ID, registry.RoleStandby)
		_, _ = reg.SetRetired(m.src.ID, true)
		m.setNewActive(m.dst.ID)
	case hostapi.PreserveSource:
		_ = reg.SetRole(m.dst.ID, registry.RoleActive)
		_ = reg.SetRole(m.src.ID, registry.RoleStandby)
		m.setNewActive(m.dst.ID)
	case hostapi.KeepSourceActive:
		m.setNewActive(m.src.ID)
	}
}

// applyType does what the migration type asks of the source: a
// destroy_source source releases its KV once the requests left on it
// finish — in the background, and the status says what came of it.
func (m *migration) applyType() {
	if m.req.Type != hostapi.DestroySource {
		m.setSourceKV(hostapi.SourceKVKept, "")
		return
	}
	m.setSourceKV(hostapi.SourceKVReleasing, "")
	o := m.o
	o.wg.Add(1)
	go func() {
		defer o.wg.Done()
		ctx, cancel := context.WithTimeout(o.ctx, o.cfg.RetireWait+time.Minute)
		defer cancel()
		resp, err := m.srcA.Retire(ctx, &v1.RetireRequest{WaitMs: o.cfg.RetireWait.Milliseconds()})
		switch {
		case err != nil && o.ctx.Err() != nil:
			m.setSourceKV(hostapi.SourceKVNotReleased, "the Host stopped before the source's remaining requests finished")
		case err != nil:
			m.setSourceKV(hostapi.SourceKVNotReleased, "retiring the source failed: "+rpcError(err).Error())
		case resp.GetReleased():
			m.setSourceKV(hostapi.SourceKVReleased, resp.GetNote())
		default:
			m.setSourceKV(hostapi.SourceKVNotReleased, resp.GetNote())
		}
	}()
}

func (m *migration) setSourceKV(state, note string) {
	m.mu.Lock()
	m.st.SourceKV, m.st.SourceKVNote = state, note
	m.mu.Unlock()
	m.o.rec.save(m.st.ID)
	if state == hostapi.SourceKVNotReleased {
		m.log.Warn("the source kept its KV", zap.String("note", note))
	}
}

func (m *migration) setNewActive(id string) {
	m.mu.Lock()
	m.st.NewActiveInstance = id
	m.mu.Unlock()
}

// pauseSource pauses the moving requests on the source at a step
// boundary (dropping any that finished meanwhile) and returns how long the
// engine waited for the step in flight. ok is false when the migration
// failed.
func (m *migration) pauseSource(ctx context.Context) (wait time.Duration, ok bool) {
	ids := m.ids()
	for attempt := 0; len(ids) > 0; attempt++ {
		cctx, cancel := m.call(ctx)
		p, err := hook[hooks.PauseResponse](cctx, m.srcA, "pause", hooks.PauseRequest{RequestIDs: ids, LeaseMS: int(m.o.cfg.PauseLease / time.Millisecond)}, 0)
		cancel()
		if err == nil {
			m.pausedSrc = true
			return time.Duration(p.StepWaitS * float64(time.Second)), true
		}
		if status.Code(err) != codes.NotFound || attempt > 3 {
			// A pause that timed out may have landed: rolling back resumes
			// whatever is paused.
			m.pausedSrc = true
			m.fail(fmt.Errorf("pause the source: %w", rpcError(err)))
			return 0, false
		}
		// Some request finished just now: drop it and pause the rest.
		if ids, err = m.liveOnSource(ctx, ids); err != nil {
			m.fail(fmt.Errorf("pause the source: %w", err))
			return 0, false
		}
	}
	return 0, true
}

// liveOnSource drops from the migration the ids no longer running on the
// source and returns the rest.
func (m *migration) liveOnSource(ctx context.Context, ids []string) ([]string, error) {
	keep, gone, err := m.splitOnSource(ctx, ids, func(r hooks.RequestInfo) bool { return r.Status == hooks.StatusRunning })
	if err != nil {
		return nil, err
	}
	m.drop(gone...)
	return keep, nil
}

// splitOnSource lists the source's requests and splits ids into those
// there for which ok holds and the rest.
func (m *migration) splitOnSource(ctx context.Context, ids []string, ok func(hooks.RequestInfo) bool) (yes, no []string, err error) {
	cctx, cancel := m.call(ctx)
	defer cancel()
	list, err := hook[hooks.RequestList](cctx, m.srcA, "requests", nil, 0)
	if err != nil {
		return nil, nil, rpcError(err)
	}
	there := map[string]bool{}
	for _, r := range list.Requests {
		there[r.RequestID] = ok(r)
	}
	for _, id := range ids {
		if there[id] {
			yes = append(yes, id)
		} else {
			no = append(no, id)
		}
	}
	return yes, no, nil
}

// resumeLeftBehind resumes on the source the requests it paused that did
// not move and still run there (a copy round dropped them), so they do
// not wait out the pause lease.
func (m *migration) resumeLeftBehind(ctx context.Context, paused, moved []string) {
	done := map[string]bool{}
	for _, id := range moved {
		done[id] = true
	}
	var rest []string
	for _, id := range paused {
		if !done[id] {
			rest = append(rest, id)
		}
	}
	m.resumeOnSource(ctx, rest)
}

// resumeOnSource resumes those of ids still paused on the source (a client
// may have left meanwhile, and resume refuses unknown ids). What it cannot
// resume, the pause lease will.
func (m *migration) resumeOnSource(ctx context.Context, ids []string) {
	if len(ids) == 0 {
		return
	}
	resume, _, err := m.splitOnSource(ctx, ids, func(r hooks.RequestInfo) bool { return r.Paused })
	if err != nil {
		m.log.Error("resuming the source failed (its pause lease will resume the requests)", zap.Strings("request_ids", ids), zap.Error(err))
		return
	}
	if len(resume) == 0 {
		return
	}
	cctx, cancel := m.call(ctx)
	defer cancel()
	if _, err := hook[hooks.ResumeResponse](cctx, m.srcA, "resume", hooks.ResumeRequest{RequestIDs: resume}, 0); err != nil {
		m.log.Error("resuming the source failed (its pause lease will resume the requests)", zap.Strings("request_ids", resume), zap.Error(err))
	}
}

// finalRound copies the last delta while the state moves: the source's
// export goes to the target untouched and the target installs it paused,
// both while the copy runs. It returns the moved requests' states once
// both are done. A request the copy dropped (its client left meanwhile)
// is taken off the target again.
func (m *migration) finalRound(ctx context.Context, since uint64) ([]movedState, error) {
	fault := m.req.InjectFault
	if fault == "crash_after_pause" {
		fault = ""
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	copied := make(chan error, 1)
	go func() {
		_, err := m.copyRound(cctx, "final", since, m.req.FinalGranularity != "block", fault)
		copied <- err
	}()
	states, err := m.moveState(ctx)
	if err != nil {
		cancel()
	}
	// Never return with the copy still writing into the target: a rollback
	// frees those blocks.
	if cerr := <-copied; cerr != nil {
		return nil, cerr
	}
	if err != nil {
		return nil, err
	}
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
		actx, acancel := m.call(ctx)
		defer acancel()
		if _, err := hook[hooks.AbortResponse](actx, m.dstA, "abort", hooks.AbortRequest{RequestIDs: gone, Silent: true, IgnoreMissing: true}, 0); err != nil {
			return nil, fmt.Errorf("take requests the copy dropped off the target: %w", rpcError(err))
		}
	}
	return kept, nil
}

// moveState exports the paused requests' state from the source and installs
// it, paused, on the target, in a few chunks side by side: encoding and
// decoding 256 requests' token ids and text is the longest part of the
// final round, and engines handle hook calls concurrently.
func (m *migration) moveState(ctx context.Context) ([]movedState, error) {
	ids := m.ids()
	n := min(maxStateChunks, (len(ids)+minStateChunk-1)/minStateChunk)
	if n <= 1 {
		return m.moveChunk(ctx, ids)
	}
	out := make([][]movedState, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		chunk := ids[i*len(ids)/n : (i+1)*len(ids)/n]
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i], errs[i] = m.moveChunk(ctx, chunk)
		}()
	}
	wg.Wait()
	var all []movedState
	for i := range n {
		if errs[i] != nil {
			return nil, errs[i]
		}
		all = append(all, out[i]...)
	}
	return all, nil
}

// State moves in up to maxStateChunks chunks of at least minStateChunk
// requests.
const (
	maxStateChunks = 8
	minStateChunk  = 16
)

// moveChunk exports some paused requests and installs them on the target.
// The export goes on as it came: the target installs into the blocks it
// reserved per request id, so nothing in it needs rewriting. The Host
// reads only what splicing and the end-to-end check need, while the
// target installs.
func (m *migration) moveChunk(ctx context.Context, ids []string) ([]movedState, error) {
	var raw []byte
	for attempt := 0; ; attempt++ {
		if len(ids) == 0 {
			return nil, nil
		}
		b, _ := json.Marshal(hooks.ExportRequest{RequestIDs: ids})
		var err error
		if raw, err = hookRaw(ctx, m.srcA, "export", b, 0); err == nil {
			break
		}
		if status.Code(err) != codes.NotFound || attempt > 3 {
			return nil, fmt.Errorf("export the source's state: %w", rpcError(err))
		}
		// A client left after the pause: its request is gone from the source.
		if ids, err = m.liveOnSource(ctx, ids); err != nil {
			return nil, fmt.Errorf("export the source's state: %w", err)
		}
	}
	if len(raw) < 2 || raw[0] != '{' {
		return nil, fmt.Errorf("export the source's state: unreadable answer")
	}
	// {"cursor":…,"requests":[…]} → {"resume":false,"lease_ms":…,"cursor":…,"requests":[…]}
	head := fmt.Sprintf(`{"resume":false,"lease_ms":%d,`, m.o.cfg.PauseLease/time.Millisecond)
	install := append([]byte(head), raw[1:]...)
	installed := make(chan error, 1)
	go func() {
		_, err := hookRaw(ctx, m.dstA, "install", install, 0)
		installed <- err
	}()
	var exp struct {
		Requests []movedState `json:"requests"`
	}
	perr := json.Unmarshal(raw, &exp)
	if err := <-installed; err != nil {
		return nil, fmt.Errorf("install on the target: %w", rpcError(err))
	}
	if perr != nil {
		return nil, fmt.Errorf("export the source's state: unreadable answer: %v", perr)
	}
	return exp.Requests, nil
}

// movedState is the part of an exported request the Host reads.
type movedState struct {
	RequestID         string        `json:"request_id"`
	OutputTokenIDs    hooks.IntList `json:"output_token_ids"`
	TextOffsets       hooks.IntList `json:"text_offsets"`
	NumComputedTokens int           `json:"num_computed_tokens"`
}

// visibleText is how much text (code points) the source's client stream
// carries once every exported output token went out.
func visibleText(st movedState) int {
	if len(st.TextOffsets) != len(st.OutputTokenIDs) {
		return -1
	}
	if len(st.TextOffsets) == 0 {
		return 0
	}
	return st.TextOffsets[len(st.TextOffsets)-1]
}

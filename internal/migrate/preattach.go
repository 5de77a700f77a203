package migrate

import (
	"time"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// preAttachMaxWait bounds how long the target holds a pre-attached
// stream for its install.
const preAttachMaxWait = 2 * time.Minute

// preAttach opens every moving stream on the target once the copy rounds
// are done, before the stage and the check (cfg.PreAttach, or a held
// cut): the HTTP requests and the engine's handlers then cost nothing
// inside the clients' gap — neither the install's, which the target's API
// server would queue behind them, nor the switch's, which reads the
// target's first tokens from a connection already open. The target waits
// for the install until the migration's deadline at most.
func (m *migration) preAttach() {
	if !(m.o.cfg.PreAttach || m.heldCut()) || m.o.proxy == nil {
		return
	}
	wait := min(max(time.Until(m.deadline), time.Second), preAttachMaxWait)
	ids := m.ids()
	for _, id := range ids {
		m.o.proxy.PreAttach(id, m.dst.Engine.URL, m.dst.ID, wait)
	}
	m.mu.Lock()
	m.preAttached = ids
	m.mu.Unlock()
}

// heldCut reports whether the final round holds the moving streams for a
// switch over their pre-attached streams: a target that derives the moved
// text (vLLM: dstStages) opens a pre-attached stream at the code point its
// client has — where the relay holds it (proxy.Stream.Hold) once the
// source's state is exported — so that after the commit each stream only
// switches connections. (Without the hold that place is known only at
// the commit, and the cut sends one attach per stream inside the gap.)
// Always so for such a target: --migration-pre-attach is for the others.
func (m *migration) heldCut() bool {
	return m.dstStages && m.o.proxy != nil
}

// hold holds the streams of ids where they are (heldCut): it returns,
// by request id, the text their clients have, for the install's TextFrom.
func (m *migration) hold(ids []string) (text, tokenIDs map[string]int) {
	if !m.heldCut() {
		return nil, nil
	}
	text, tokenIDs = map[string]int{}, map[string]int{}
	var held []string
	for _, id := range ids {
		if s := m.o.streams.Get(id); s != nil {
			if t, n, ok := s.Hold(); ok {
				text[id] = t
				if n >= 0 {
					tokenIDs[id] = n
				}
				held = append(held, id)
			}
		}
	}
	m.mu.Lock()
	m.held = append(m.held, held...)
	m.mu.Unlock()
	return text, tokenIDs
}

// releaseHolds lets the held streams' relays go on from the source (the
// migration did not commit, or their requests did not move); a stream the
// switch cut over is no longer held.
func (m *migration) releaseHolds() {
	m.mu.Lock()
	ids := m.held
	m.held = nil
	m.mu.Unlock()
	for _, id := range ids {
		if s := m.o.streams.Get(id); s != nil {
			s.Release()
		}
	}
}

// dropPreAttach ends the pre-attached streams of a migration that did not
// commit: they stay on the source.
func (m *migration) dropPreAttach() {
	m.mu.Lock()
	ids := m.preAttached
	m.preAttached = nil
	m.mu.Unlock()
	for _, id := range ids {
		m.o.proxy.DropPreAttach(id, m.dst.ID)
	}
}

// countPreAttached records how many moved streams switched over their
// pre-attached connection.
func (m *migration) countPreAttached(spliced []*proxy.Stream) {
	n := 0
	for _, s := range spliced {
		if s.PreAttached() {
			n++
		}
	}
	m.mu.Lock()
	m.st.PreAttached = n
	m.mu.Unlock()
}

package migrate

import (
	"time"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// preAttachMaxWait bounds how long the target holds a pre-attached
// stream for its install.
const preAttachMaxWait = 2 * time.Minute

// preAttach opens every moving stream on the target just before the
// pause (cfg.PreAttach): the HTTP request and the engine's handler then
// cost nothing inside the clients' gap — the switch after the commit reads
// the target's first tokens from a connection already open. The target
// waits for the install until the migration's deadline at most.
func (m *migration) preAttach() {
	// A target that derives the moved text (vLLM: dstStages) is switched
	// to by a cut, whose stream opens at the code point its client has,
	// known only then; a stream opened before would start reading the
	// target's outputs the moment it resumes, whether or not the relay
	// ends up reading it.
	if !m.o.cfg.PreAttach || m.o.proxy == nil || m.dstStages {
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

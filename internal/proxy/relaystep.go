package proxy

import "time"

// relayState is what a stream's relay carries from one event to the next,
// on whichever of its two loops reads the stream now: the goroutine's
// (relay) or the event loop's (evloop_linux.go), which hands the stream
// to the goroutine's with this state when it cannot go on alone.
type relayState struct {
	res Result
	// sawRole: the client got chat's role event; a replayed stream skips
	// that and the skipTokens token events the client has.
	sawRole, skipRole bool
	skipTokens        int
	stripBuf          []byte // an event without the token ids the Host asked for
}

// eventStep is what the relay does with one event.
type eventStep int

const (
	stepWrite eventStep = iota // the event's bytes go to the client
	stepSkip                   // nothing goes to the client
	stepCut                    // stop reading this upstream (a fence or a cut); the event is dropped
	stepHeld                   // the stream is held and nothing was done: a relay that may wait takes the event (only where wait is false)
)

// admit decides on one event read from the engine at read: what of it
// the client gets (raw, valid until the next call) and what the relay
// does. It counts the stream's tokens and notes their ids. wait says the
// caller may block while the stream is held (a migration's commit is
// pending); without it a held stream's token answers stepHeld, untouched.
func (p *Proxy) admit(st *relayState, s *Stream, ev Event, read time.Time, wait bool) (raw []byte, kind Kind, step eventStep) {
	kind, textLen, _ := ClassifyText(ev.Data)
	switch {
	case kind == KindRole && st.skipRole:
		st.skipRole = false
		return nil, kind, stepSkip
	case kind == KindToken && st.skipTokens > 0:
		st.skipTokens--
		return nil, kind, stepSkip
	case kind == KindRole:
		st.sawRole = true
	}
	if kind == KindToken {
		ok, held := true, false
		if wait {
			ok = s.countToken(textLen, read, ev.Data)
		} else {
			ok, held = s.countTokenNow(textLen, read, ev.Data)
		}
		switch {
		case held:
			return nil, kind, stepHeld
		case !ok:
			// The source went on past what it exported (its pause lease
			// ran out), or a cut is pending: the target produces these
			// tokens now, so this one must not reach the client.
			return nil, kind, stepCut
		}
		st.res.Tokens++
		p.m.StreamTokens.Inc()
	}
	raw = ev.Raw
	if s.ids != nil {
		heldBack := kind == KindOther && heldBackChunk(ev.Data)
		switch {
		case heldBack:
			ok, held := true, false
			if wait {
				ok = s.countHeldBackIDs(ev.Data)
			} else {
				ok, held = s.countHeldBackIDsNow(ev.Data)
			}
			switch {
			case held:
				return nil, kind, stepHeld
			case !ok:
				return nil, kind, stepCut // held past the switch: its id comes from the target
			}
		case kind != KindToken: // a token event's ids were noted as it was counted
			s.noteTokenIDs(kind, ev.Data)
		}
		if !s.ids.clients && heldBack {
			return nil, kind, stepSkip // sent only because the Host asked for ids
		}
		if !s.ids.clients && hasTokenIDLists(ev.Data) {
			raw = withoutTokenIDs(raw, st.stripBuf)
			st.stripBuf = raw[:0]
		}
	}
	return raw, kind, stepWrite
}

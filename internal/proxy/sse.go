// Package proxy is the Host's OpenAI proxy: its own SSE loop rather than
// httputil.ReverseProxy, because a migration splices a second upstream into
// the same client stream, so the Host must see every event, count tokens,
// and own the client connection.
package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"unicode/utf8"
)

// maxEventBytes bounds one SSE event from an engine.
const maxEventBytes = 4 << 20

// Event is one SSE event as read from an upstream.
type Event struct {
	Raw  []byte // the whole event, lines and terminating blank line, as received
	Data []byte // the payload of its data: line(s), joined with \n
}

// Kind says what an OpenAI stream event carries.
type Kind int

// Event kinds.
const (
	KindOther  Kind = iota // comments, events without data
	KindRole               // chat's first chunk: the assistant role, no token
	KindToken              // carries one output token (text may be empty: held-back stop text)
	KindFinish             // a finish_reason with no new token
	KindUsage              // the usage-only chunk (choices: [])
	KindError              // an error object
	KindDone               // data: [DONE]
)

// EventReader reads SSE events. The Raw and Data of an event it returns
// stay valid until the next call to Next (buffers are reused: the relay
// writes each event before reading the next).
type EventReader struct {
	r         *bufio.Reader
	raw, data []byte
}

// NewEventReader reads events from r.
func NewEventReader(r io.Reader) *EventReader {
	return &EventReader{r: bufio.NewReaderSize(r, 32<<10)}
}

// Buffered reports whether more input is already in hand, so a writer can
// batch a flush.
func (er *EventReader) Buffered() bool { return er.r.Buffered() > 0 }

// ErrEventTooLarge is returned for an event over maxEventBytes.
var ErrEventTooLarge = errors.New("sse: event too large")

// Next returns the next event. At a clean end of stream it returns io.EOF;
// a stream cut inside an event returns io.ErrUnexpectedEOF.
func (er *EventReader) Next() (Event, error) {
	raw, data := er.raw[:0], er.data[:0]
	hasData := false
	defer func() { er.raw, er.data = raw[:0], data[:0] }()
	for {
		line, err := er.r.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			// A long line: fall back to accumulating.
			acc := append([]byte(nil), line...)
			for err == bufio.ErrBufferFull {
				if len(acc) > maxEventBytes {
					return Event{}, ErrEventTooLarge
				}
				line, err = er.r.ReadSlice('\n')
				acc = append(acc, line...)
			}
			line = acc
		}
		if err != nil {
			if err == io.EOF && len(raw) == 0 && len(line) == 0 {
				return Event{}, io.EOF
			}
			if err == io.EOF {
				return Event{}, io.ErrUnexpectedEOF
			}
			return Event{}, err
		}
		raw = append(raw, line...)
		if len(raw) > maxEventBytes {
			return Event{}, ErrEventTooLarge
		}
		content := bytes.TrimRight(line, "\r\n")
		if len(content) == 0 {
			if len(raw) == len(line) {
				raw = raw[:0] // a stray blank line between events
				continue
			}
			ev := Event{Raw: raw}
			if hasData {
				ev.Data = data
			}
			return ev, nil
		}
		if v, ok := bytes.CutPrefix(content, []byte("data:")); ok {
			v = bytes.TrimPrefix(v, []byte(" "))
			if hasData {
				data = append(data, '\n')
			}
			data = append(data, v...)
			hasData = true
		}
	}
}

// chunkShape is the part of an OpenAI chunk the Host needs to classify it.
type chunkShape struct {
	Choices *[]struct {
		Text  *string `json:"text"`
		Delta *struct {
			Role    *string `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Error json.RawMessage `json:"error"`
}

var (
	keyChoices     = []byte(`"choices":`)
	keyRoleDelta   = []byte(`"delta":{"role":`)
	keyText        = []byte(`"text":"`)
	keyContent     = []byte(`"delta":{"content":"`)
	keyRoleContent = []byte(`"content":"`)
	keyError       = []byte(`{"error":`)
	keyToolsDelta  = []byte(`"tool_calls"`)
)

// Classify says what an event carries. vLLM's and the sim's chunks have a
// fixed shape, so the common cases are recognised by their structural keys
// (a key's quotes cannot occur unescaped inside a JSON string, so these
// byte patterns only match structure); anything else is decoded properly.
func Classify(data []byte) (Kind, error) {
	k, _, err := ClassifyText(data)
	return k, err
}

// TextLen is the number of Unicode code points of text an event carries
// (a completion's "text" or a chat delta's "content").
func TextLen(data []byte) int {
	_, n, _ := ClassifyText(data)
	return n
}

// ClassifyText is Classify plus the event's text length in Unicode code
// points: the unit of the engines' text offsets (Python's len). vLLM
// merges several tokens into one chunk when its reader lags, so the
// relayed text, not the number of chunks, tells how far a client got. One
// pass over the event does both: the relay calls it for every event.
func ClassifyText(data []byte) (Kind, int, error) {
	if data == nil {
		return KindOther, 0, nil
	}
	if bytes.Equal(data, []byte("[DONE]")) {
		return KindDone, 0, nil
	}
	if bytes.HasPrefix(data, keyError) {
		return KindError, 0, nil
	}
	if i := bytes.Index(data, keyChoices); i >= 0 && !bytes.Contains(data, keyToolsDelta) {
		rest := data[i+len(keyChoices):]
		switch {
		case bytes.HasPrefix(rest, []byte("[]")):
			return KindUsage, 0, nil
		case bytes.HasPrefix(rest, []byte("[{")) && bytes.Contains(rest, keyRoleDelta):
			if n, ok := stringAfter(rest, keyRoleContent); ok {
				return KindRole, n, nil
			}
		case bytes.HasPrefix(rest, []byte("[{")):
			for _, key := range [][]byte{keyText, keyContent} {
				if n, ok := stringAfter(rest, key); ok {
					return KindToken, n, nil
				}
			}
		}
	}
	return classifySlow(data)
}

// stringAfter counts the code points of the JSON string that key (which
// ends with the string's opening quote) starts; ok is false when key is
// absent (or the string is cut).
func stringAfter(data, key []byte) (int, bool) {
	i := bytes.Index(data, key)
	if i < 0 {
		return 0, false
	}
	return jsonStringRunes(data[i+len(key):])
}

// jsonStringRunes counts the code points of a JSON string body up to its
// closing quote without decoding it: a \uXXXX escape is one code point,
// except the low half of a surrogate pair right after its high half,
// which completes it. (A lone surrogate is one code point, as Python's
// len and Go's decoder, which makes it U+FFFD, both count it.)
func jsonStringRunes(b []byte) (int, bool) {
	n := 0
	high := false // the previous code point was a \uD800-\uDBFF escape
	for i := 0; i < len(b); i++ {
		c := b[i]
		switch {
		case c == '"':
			return n, true
		case c == '\\':
			if i+1 >= len(b) {
				return 0, false
			}
			if b[i+1] == 'u' {
				if i+5 >= len(b) {
					return 0, false
				}
				hex := b[i+2 : i+6]
				if !(high && isSurrogate(hex, "cdefCDEF")) {
					n++
				}
				high = !high && isSurrogate(hex, "89abAB")
				i += 5
				continue
			}
			n++
			i++
		case c < utf8.RuneSelf:
			n++
		default:
			// A UTF-8 sequence is one code point; so is each byte that is
			// not valid UTF-8 (Go's decoder makes it U+FFFD).
			_, size := utf8.DecodeRune(b[i:])
			n++
			i += size - 1
		}
		high = false
	}
	return 0, false
}

// isSurrogate reports whether the escape's hex digits are \uDxyy with x
// one of second.
func isSurrogate(hex []byte, second string) bool {
	return (hex[0] == 'd' || hex[0] == 'D') && strings.ContainsRune(second, rune(hex[1]))
}

// classifySlow decodes the event.
func classifySlow(data []byte) (Kind, int, error) {
	var c chunkShape
	if err := json.Unmarshal(data, &c); err != nil {
		return KindOther, 0, fmt.Errorf("sse: event is not JSON: %w", err)
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		return KindError, 0, nil
	}
	if c.Choices == nil {
		return KindOther, 0, nil
	}
	if len(*c.Choices) == 0 {
		return KindUsage, 0, nil
	}
	ch := (*c.Choices)[0]
	n := 0
	switch {
	case ch.Text != nil:
		n = utf8.RuneCountInString(*ch.Text)
	case ch.Delta != nil && ch.Delta.Content != nil:
		n = utf8.RuneCountInString(*ch.Delta.Content)
	}
	switch {
	case ch.Delta != nil && ch.Delta.Role != nil:
		return KindRole, n, nil
	case ch.Text != nil || (ch.Delta != nil && ch.Delta.Content != nil):
		// One content chunk per output token (vLLM streams one per step
		// and request; the sim one per token). A finishing chunk with empty
		// text is ambiguous, but once a stream finished its count no longer
		// matters for splicing.
		return KindToken, n, nil
	case ch.FinishReason != nil:
		return KindFinish, 0, nil
	}
	return KindOther, 0, nil
}

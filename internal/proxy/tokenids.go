package proxy

import "bytes"

// The relay learns each stream's token ids from vLLM itself: asked with
// "return_token_ids": true, vLLM's chunks carry the prompt's ids (the
// first chunk) and each chunk's new output ids. A failover then hands a
// survivor exactly the tokens the client has (prompt and output), however
// long ago the last snapshot was. When the Host asked for them and the
// client did not, the relay gives the client the chunk vLLM would have
// sent it: the lists become null again, byte for byte.

var (
	keyEmptyDelta     = []byte(`"delta":{},`)
	keyNoFinish       = []byte(`"finish_reason":null`)
	keyReturnTokenIDs = []byte(`"return_token_ids"`)
	keyTokenIDs       = []byte(`"token_ids":`)
	keyPromptIDs      = []byte(`"prompt_token_ids":`)
)

// WithReturnTokenIDs is a request body that asks vLLM for token ids: body
// with "return_token_ids": true added first. ok is false, and body comes
// back as it was, when the client's body names the field itself (its
// choice stands: the relay then passes its chunks on untouched) or is not
// a JSON object.
func WithReturnTokenIDs(body []byte) (out []byte, ok bool) {
	i := 0
	for i < len(body) && (body[i] == ' ' || body[i] == '\t' || body[i] == '\r' || body[i] == '\n') {
		i++
	}
	if i >= len(body) || body[i] != '{' || bytes.Contains(body, keyReturnTokenIDs) {
		return body, false
	}
	rest := bytes.TrimLeft(body[i+1:], " \t\r\n")
	sep := ","
	if len(rest) > 0 && rest[0] == '}' {
		sep = "" // an empty object
	}
	out = make([]byte, 0, len(body)+len(keyReturnTokenIDs)+8)
	out = append(out, body[:i+1]...)
	out = append(out, keyReturnTokenIDs...)
	out = append(out, ":true"...)
	out = append(out, sep...)
	return append(out, body[i+1:]...), true
}

// intList parses the JSON list of non-negative integers that b starts
// with ("[1, 2]"), appending them to dst without allocating beyond it; n
// is its length in bytes, ok false when b does not start with one.
func intList(b []byte, dst []int) (ids []int, n int, ok bool) {
	if len(b) == 0 || b[0] != '[' {
		return dst, 0, false
	}
	start := len(dst)
	v, digits := 0, 0
	for i := 1; i < len(b); i++ {
		switch c := b[i]; {
		case c >= '0' && c <= '9':
			if digits > 18 {
				return dst[:start], 0, false
			}
			v, digits = v*10+int(c-'0'), digits+1
		case c == ',' || c == ']':
			if digits == 0 && (c == ',' || len(dst) > start) {
				return dst[:start], 0, false // an empty element
			}
			if digits > 0 {
				dst = append(dst, v)
			}
			if c == ']' {
				return dst, i + 1, true
			}
			v, digits = 0, 0
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
		default:
			return dst[:start], 0, false
		}
	}
	return dst[:start], 0, false
}

// intListLen is the length in bytes of the JSON list of integers that b
// starts with (ok false when it does not start with one), read without
// keeping the integers (a chunk's few fit the scratch on the stack).
func intListLen(b []byte) (n int, ok bool) {
	var scratch [4]int
	_, n, ok = intList(b, scratch[:0])
	return n, ok
}

// tokenIDsOf reads the ids an event's data carries: the prompt's (the
// first chunk) and the new output tokens'. found is false when the event
// carries no output id list (an engine not asked, or one that does not
// answer the field: the sim, the plugin's streams before it did).
func tokenIDsOf(data []byte, prompt, output []int) (p, o []int, found bool) {
	p, o = prompt, output
	if i := bytes.Index(data, keyPromptIDs); i >= 0 {
		p, _, _ = intList(data[i+len(keyPromptIDs):], p)
	}
	// (The key's opening quote keeps "prompt_token_ids": from matching.)
	i := bytes.Index(data, keyTokenIDs)
	if i < 0 {
		return p, o, false
	}
	var ok bool
	o, _, ok = intList(data[i+len(keyTokenIDs):], o)
	return p, o, ok
}

// keyIDList ends both keys' list values: an event without it has no list
// to make null.
var keyIDList = []byte(`token_ids":[`)

// hasTokenIDLists reports whether an event carries an id list.
func hasTokenIDLists(data []byte) bool { return bytes.Contains(data, keyIDList) }

// withoutTokenIDs is raw with every id list the Host asked for made null
// again, as vLLM writes the fields for a client that did not ask (it sets
// them explicitly, so they are there, null). buf is reused.
func withoutTokenIDs(raw, buf []byte) []byte {
	out := buf[:0]
	for {
		i, key := bytes.Index(raw, keyTokenIDs), keyTokenIDs
		if k := bytes.Index(raw, keyPromptIDs); k >= 0 && (i < 0 || k < i) {
			i, key = k, keyPromptIDs
		}
		if i < 0 {
			return append(out, raw...)
		}
		j := i + len(key)
		n, ok := intListLen(raw[j:])
		out = append(out, raw[:j]...)
		if ok {
			out = append(out, "null"...)
			raw = raw[j+n:]
		} else {
			raw = raw[j:]
		}
	}
}

// heldBackChunk reports whether a chat chunk is one vLLM sends only
// because it was asked for token ids: an empty delta, not the last (a
// token whose text a reasoning or tool parser holds back; without the ids
// vLLM skips it). The relay keeps its ids and does not pass it on.
func heldBackChunk(data []byte) bool {
	return bytes.Contains(data, keyEmptyDelta) && bytes.Contains(data, keyNoFinish)
}

package host

import (
	"encoding/json"
	"testing"
)

// The relay asks for token ids only where they are exactly its client's
// output tokens and chunks: one choice, no echo of the prompt, and for chat
// no logprobs.
func TestTokenIDsExact(t *testing.T) {
	for _, c := range []struct {
		path, body string
		want       bool
	}{
		{"/v1/completions", `{"model":"m","prompt":"x","stream":true}`, true},
		{"/v1/completions", `{"model":"m","n":1,"best_of":1}`, true},
		{"/v1/completions", `{"model":"m","n":2}`, false},
		{"/v1/completions", `{"model":"m","best_of":3}`, false},
		{"/v1/completions", `{"model":"m","echo":true}`, false},
		{"/v1/completions", `{"model":"m","n":"two"}`, false},
		{"/v1/completions", `not json`, false},
		{"/v1/chat/completions", `{"model":"m","messages":[]}`, true},
		{"/v1/chat/completions", `{"model":"m","logprobs":false}`, true},
		{"/v1/chat/completions", `{"model":"m","logprobs":true}`, false},
		{"/v1/chat/completions", `{"model":"m","top_logprobs":2}`, false},
		{"/v1/chat/completions", `{"model":"m","n":3}`, false},
		{"/v1/embeddings", `{"model":"m"}`, false},
	} {
		var f idFields
		if err := json.Unmarshal([]byte(c.body), &f); err != nil {
			f = idFields{N: json.RawMessage(`"unreadable"`)} // the Host answers such a body 400 before
		}
		if got := tokenIDsExact(c.path, f); got != c.want {
			t.Errorf("%s %s: %v, want %v", c.path, c.body, got, c.want)
		}
	}
}

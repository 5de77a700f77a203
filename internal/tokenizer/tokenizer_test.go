package tokenizer

import (
	"testing"
	"unicode/utf8"
)

func TestRoundTrip(t *testing.T) {
	tok := New()
	for _, s := range []string{"", "hello world", "Hello, World! ünïcödé 日本語", " the  model\n\ttoken", "kabo zizu"} {
		ids := tok.Encode(s)
		if got := tok.Decode(ids); got != s {
			t.Errorf("round trip %q → %v → %q", s, ids, got)
		}
	}
	if ids := tok.Encode(" hello world"); len(ids) != 2 {
		t.Errorf("common words should be single tokens: %v", ids)
	}
}

func TestWordsReadAsText(t *testing.T) {
	tok := New()
	for i := uint64(0); i < 10000; i += 7 {
		p := tok.Piece(tok.WordID(i))
		if p == "" || !utf8.ValidString(p) {
			t.Fatalf("word %d is %q", i, p)
		}
	}
	if tok.Piece(EOS) != "" || tok.Piece(-1) != "" || tok.Piece(1<<30) != "" {
		t.Fatal("specials and unknown ids must decode to nothing")
	}
}

func TestChatTemplate(t *testing.T) {
	tok := New()
	ids := tok.ApplyChatTemplate([]ChatMessage{{Role: "user", Content: "hi"}})
	if ids[0] != ImStart || tok.Decode(ids) != "user\nhi\nassistant\n" {
		t.Fatalf("template: %v → %q", ids, tok.Decode(ids))
	}
}

// Package tokenizer is a small deterministic tokenizer for vhi sim: prompts
// become token ids, generated ids read back as text. It is byte-complete
// (every string encodes), so any prompt round-trips exactly.
package tokenizer

import (
	"strings"
)

// Special token ids. Bytes take ids 0..255.
const (
	EOS         = 256 // <|endoftext|>
	ImStart     = 257 // <|im_start|>
	ImEnd       = 258 // <|im_end|>
	firstWordID = 259
)

var specials = map[int]string{EOS: "<|endoftext|>", ImStart: "<|im_start|>", ImEnd: "<|im_end|>"}

// commonWords gives ordinary prompts real word tokens instead of bytes.
var commonWords = strings.Fields(`the of and to a in is it you that he was for on are with as i his they be at one
have this from or had by hot word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who may down
side been now find any new work part take get place made live where after back little only round man year came show
every good me give our under name very through just form sentence great think say help low line differ turn cause
much mean before move right boy old too same tell does set three want air well also play small end put home read
hand port large spell add even land here must big high such follow act why ask men change went light kind off need
house picture try us again animal point mother world near build self earth father hello story model token stream`)

// Tokenizer maps text to ids and back.
type Tokenizer struct {
	pieces []string       // id → text
	ids    map[string]int // text → id (words only)
	words  int            // number of word ids, starting at firstWordID
}

// New builds the vocabulary: 256 bytes, 3 specials, the common words with
// and without a leading space, then every one- and two-syllable word made
// of 15 consonants and 5 vowels, each with a leading space.
func New() *Tokenizer {
	t := &Tokenizer{ids: map[string]int{}}
	t.pieces = make([]string, firstWordID)
	for b := 0; b < 256; b++ {
		t.pieces[b] = string([]byte{byte(b)})
	}
	for id, s := range specials {
		t.pieces[id] = s
	}
	add := func(w string) {
		if _, ok := t.ids[w]; ok {
			return
		}
		t.ids[w] = len(t.pieces)
		t.pieces = append(t.pieces, w)
	}
	for _, w := range commonWords {
		add(" " + w)
	}
	for _, w := range commonWords {
		add(w)
	}
	var sylls []string
	for _, c := range "bdfghklmnprstvz" {
		for _, v := range "aeiou" {
			sylls = append(sylls, string(c)+string(v))
		}
	}
	for _, a := range sylls {
		add(" " + a)
	}
	for _, a := range sylls {
		for _, b := range sylls {
			add(" " + a + b)
		}
	}
	t.words = len(t.pieces) - firstWordID
	return t
}

// VocabSize is the number of token ids.
func (t *Tokenizer) VocabSize() int { return len(t.pieces) }

// WordID returns the i-th word token (i taken modulo the number of words):
// the sampler draws generated tokens from words only, so output reads as text.
func (t *Tokenizer) WordID(i uint64) int { return firstWordID + int(i%uint64(t.words)) }

// Encode turns text into ids: an optional space plus a run of ASCII letters
// becomes one word token when the vocabulary has it; everything else is
// encoded byte by byte.
func (t *Tokenizer) Encode(text string) []int {
	out := make([]int, 0, len(text)/4+1)
	for i := 0; i < len(text); {
		j := i
		if text[j] == ' ' {
			j++
		}
		k := j
		for k < len(text) && isLetter(text[k]) {
			k++
		}
		if k > j {
			if id, ok := t.ids[text[i:k]]; ok {
				out = append(out, id)
				i = k
				continue
			}
		}
		out = append(out, int(text[i]))
		i++
	}
	return out
}

// Decode turns ids into text. Special tokens are skipped, as vLLM does with
// skip_special_tokens=true; unknown ids decode to nothing.
func (t *Tokenizer) Decode(ids []int) string {
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(t.Piece(id))
	}
	return b.String()
}

// Piece is the text of one id ("" for specials and unknown ids).
func (t *Tokenizer) Piece(id int) string {
	if id < 0 || id >= len(t.pieces) {
		return ""
	}
	if _, special := specials[id]; special {
		return ""
	}
	return t.pieces[id]
}

// ChatMessage is one turn of a conversation.
type ChatMessage struct {
	Role    string
	Content string
}

// ApplyChatTemplate renders messages in ChatML and appends the assistant
// prompt, returning token ids.
func (t *Tokenizer) ApplyChatTemplate(msgs []ChatMessage) []int {
	var out []int
	for _, m := range msgs {
		out = append(out, ImStart)
		out = append(out, t.Encode(m.Role+"\n"+m.Content)...)
		out = append(out, ImEnd)
		out = append(out, '\n')
	}
	out = append(out, ImStart)
	out = append(out, t.Encode("assistant\n")...)
	return out
}

func isLetter(c byte) bool { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') }

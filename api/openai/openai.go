// Package openai holds the OpenAI-compatible wire types vLLM serves, with
// the field order and null-handling of vLLM's own serializer, so vhi sim's
// bytes look like vLLM's and the Host can parse either.
package openai

import (
	"encoding/json"
	"fmt"
)

// StreamOptions is the request's stream_options.
type StreamOptions struct {
	IncludeUsage         bool `json:"include_usage"`
	ContinuousUsageStats bool `json:"continuous_usage_stats"`
}

// StringOrList accepts "x" or ["x", "y"].
type StringOrList []string

// UnmarshalJSON implements json.Unmarshaler.
func (s *StringOrList) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*s = nil
		return nil
	}
	var one string
	if err := json.Unmarshal(b, &one); err == nil {
		*s = StringOrList{one}
		return nil
	}
	var many []string
	if err := json.Unmarshal(b, &many); err != nil {
		return fmt.Errorf("expected a string or a list of strings")
	}
	*s = many
	return nil
}

// Prompt accepts a string, a list of one string, or a list of token ids.
type Prompt struct {
	Text   string
	Tokens []int
	IsText bool
	Count  int // number of prompts given
}

// UnmarshalJSON implements json.Unmarshaler.
func (p *Prompt) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*p = Prompt{Text: s, IsText: true, Count: 1}
		return nil
	}
	var ss []string
	if err := json.Unmarshal(b, &ss); err == nil {
		*p = Prompt{IsText: true, Count: len(ss)}
		if len(ss) > 0 {
			p.Text = ss[0]
		}
		return nil
	}
	var ids []int
	if err := json.Unmarshal(b, &ids); err == nil {
		*p = Prompt{Tokens: ids, Count: 1}
		return nil
	}
	return fmt.Errorf("prompt must be a string, a list of strings or a list of token ids")
}

// SamplingFields are the sampling parameters both endpoints share.
type SamplingFields struct {
	Model         string         `json:"model"`
	MaxTokens     *int           `json:"max_tokens"`
	Temperature   *float64       `json:"temperature"`
	TopP          *float64       `json:"top_p"`
	Seed          *int64         `json:"seed"`
	Stream        bool           `json:"stream"`
	StreamOptions *StreamOptions `json:"stream_options"`
	IgnoreEOS     bool           `json:"ignore_eos"`
	Stop          StringOrList   `json:"stop"`
	StopTokenIDs  []int          `json:"stop_token_ids"`
	N             *int           `json:"n"`
	Priority      int            `json:"priority"`
	// ReturnTokenIDs: the chunks carry the prompt's and each new token's
	// ids (vLLM's return_token_ids).
	ReturnTokenIDs bool `json:"return_token_ids"`
}

// CompletionRequest is POST /v1/completions.
type CompletionRequest struct {
	SamplingFields
	Prompt *Prompt `json:"prompt"`
}

// ChatMessage is one message of a chat request. Content may be a string or
// a list of {"type":"text","text":…} parts.
type ChatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// Text flattens the message's content.
func (m ChatMessage) Text() (string, error) {
	if len(m.Content) == 0 || string(m.Content) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(m.Content, &s); err == nil {
		return s, nil
	}
	var parts []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	if err := json.Unmarshal(m.Content, &parts); err != nil {
		return "", fmt.Errorf("message content must be a string or a list of parts")
	}
	out := ""
	for _, p := range parts {
		if p.Type != "text" {
			return "", fmt.Errorf("content part type %q is not supported", p.Type)
		}
		out += p.Text
	}
	return out, nil
}

// ChatCompletionRequest is POST /v1/chat/completions.
type ChatCompletionRequest struct {
	SamplingFields
	Messages            []ChatMessage `json:"messages"`
	MaxCompletionTokens *int          `json:"max_completion_tokens"`
}

// Usage is vLLM's UsageInfo as it appears in responses. The detail
// fields are *any so they can be an explicit null (non-streaming answers,
// continuous usage) or absent (the final usage chunk), as vLLM sends them.
type Usage struct {
	PromptTokens            int  `json:"prompt_tokens"`
	TotalTokens             int  `json:"total_tokens"`
	CompletionTokens        int  `json:"completion_tokens"`
	PromptTokensDetails     *any `json:"prompt_tokens_details,omitempty"`
	CompletionTokensDetails *any `json:"completion_tokens_details,omitempty"`
}

var null any

// Null is a pointer to a nil any: it marshals as an explicit null.
func Null() *any { return &null }

// ErrorInfo is the body of an OpenAI error.
type ErrorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// ErrorResponse is {"error": {...}}.
type ErrorResponse struct {
	Error ErrorInfo `json:"error"`
}

// NewError builds an error body.
func NewError(code int, typ, param, msg string) ErrorResponse {
	e := ErrorResponse{Error: ErrorInfo{Message: msg, Type: typ, Code: code}}
	if param != "" {
		e.Error.Param = &param
	}
	return e
}

// CompletionChoice is a non-streaming completion choice.
type CompletionChoice struct {
	Index          int    `json:"index"`
	Text           string `json:"text"`
	Logprobs       any    `json:"logprobs"`
	FinishReason   any    `json:"finish_reason"`
	StopReason     any    `json:"stop_reason"`
	TokenIDs       []int  `json:"token_ids"`
	PromptLogprobs any    `json:"prompt_logprobs"`
	PromptTokenIDs []int  `json:"prompt_token_ids"`
	RoutedExperts  any    `json:"routed_experts"`
}

// CompletionResponse is a non-streaming completion.
type CompletionResponse struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Choices           []CompletionChoice `json:"choices"`
	ServiceTier       any                `json:"service_tier"`
	SystemFingerprint any                `json:"system_fingerprint"`
	Usage             Usage              `json:"usage"`
	KVTransferParams  any                `json:"kv_transfer_params"`
	ECTransferParams  any                `json:"ec_transfer_params"`
	Metrics           any                `json:"metrics"`
}

// CompletionStreamChoice is one streamed completion choice.
type CompletionStreamChoice struct {
	Index          int    `json:"index"`
	Text           string `json:"text"`
	Logprobs       any    `json:"logprobs"`
	FinishReason   any    `json:"finish_reason"`
	StopReason     any    `json:"stop_reason"`
	PromptTokenIDs []int  `json:"prompt_token_ids"`
	TokenIDs       []int  `json:"token_ids"`
}

// CompletionChunk is one streamed completion event.
type CompletionChunk struct {
	ID                string                   `json:"id"`
	Object            string                   `json:"object"`
	Created           int64                    `json:"created"`
	Model             string                   `json:"model"`
	Choices           []CompletionStreamChoice `json:"choices"`
	Usage             *Usage                   `json:"usage,omitempty"`
	SystemFingerprint string                   `json:"system_fingerprint,omitempty"`
}

// ChatMessageOut is the assistant message of a non-streaming chat response.
type ChatMessageOut struct {
	Role         string `json:"role"`
	Content      string `json:"content"`
	Refusal      any    `json:"refusal"`
	Annotations  any    `json:"annotations"`
	Audio        any    `json:"audio"`
	FunctionCall any    `json:"function_call"`
	Reasoning    any    `json:"reasoning"`
}

// ChatChoice is a non-streaming chat choice.
type ChatChoice struct {
	Index         int            `json:"index"`
	Message       ChatMessageOut `json:"message"`
	Logprobs      any            `json:"logprobs"`
	FinishReason  any            `json:"finish_reason"`
	StopReason    any            `json:"stop_reason"`
	TokenIDs      []int          `json:"token_ids"`
	RoutedExperts any            `json:"routed_experts"`
}

// ChatResponse is a non-streaming chat completion.
type ChatResponse struct {
	ID                string       `json:"id"`
	Object            string       `json:"object"`
	Created           int64        `json:"created"`
	Model             string       `json:"model"`
	Choices           []ChatChoice `json:"choices"`
	ServiceTier       any          `json:"service_tier"`
	SystemFingerprint any          `json:"system_fingerprint"`
	Usage             Usage        `json:"usage"`
	PromptLogprobs    any          `json:"prompt_logprobs"`
	PromptTokenIDs    []int        `json:"prompt_token_ids"`
	PromptText        any          `json:"prompt_text"`
	KVTransferParams  any          `json:"kv_transfer_params"`
	ECTransferParams  any          `json:"ec_transfer_params"`
	Metrics           any          `json:"metrics"`
}

// Delta is a streamed chat delta; vLLM omits unset fields.
type Delta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

// ChatStreamChoice is one streamed chat choice. vLLM sets stop_reason only
// on the finishing chunk and token_ids on every content chunk. Optional
// fields that vLLM writes as an explicit null are *any: a pointer to a nil
// any marshals as null, a nil pointer is left out.
type ChatStreamChoice struct {
	Index        int   `json:"index"`
	Delta        Delta `json:"delta"`
	Logprobs     any   `json:"logprobs"`
	FinishReason any   `json:"finish_reason"`
	StopReason   *any  `json:"stop_reason,omitempty"`
	TokenIDs     *any  `json:"token_ids,omitempty"`
}

// ChatChunk is one streamed chat event.
type ChatChunk struct {
	ID                string             `json:"id"`
	Object            string             `json:"object"`
	Created           int64              `json:"created"`
	Model             string             `json:"model"`
	Choices           []ChatStreamChoice `json:"choices"`
	Usage             *Usage             `json:"usage,omitempty"`
	SystemFingerprint string             `json:"system_fingerprint,omitempty"`
	PromptTokenIDs    *any               `json:"prompt_token_ids,omitempty"`
	PromptText        *any               `json:"prompt_text,omitempty"`
}

// ModelCard is one entry of /v1/models.
type ModelCard struct {
	ID          string            `json:"id"`
	Object      string            `json:"object"`
	Created     int64             `json:"created"`
	OwnedBy     string            `json:"owned_by"`
	Root        *string           `json:"root"`
	Parent      *string           `json:"parent"`
	MaxModelLen *int              `json:"max_model_len"`
	Permission  []ModelPermission `json:"permission"`
}

// ModelPermission is vLLM's model permission entry.
type ModelPermission struct {
	ID                 string  `json:"id"`
	Object             string  `json:"object"`
	Created            int64   `json:"created"`
	AllowCreateEngine  bool    `json:"allow_create_engine"`
	AllowSampling      bool    `json:"allow_sampling"`
	AllowLogprobs      bool    `json:"allow_logprobs"`
	AllowSearchIndices bool    `json:"allow_search_indices"`
	AllowView          bool    `json:"allow_view"`
	AllowFineTuning    bool    `json:"allow_fine_tuning"`
	Organization       string  `json:"organization"`
	Group              *string `json:"group"`
	IsBlocking         bool    `json:"is_blocking"`
}

// ModelList is GET /v1/models.
type ModelList struct {
	Object string      `json:"object"`
	Data   []ModelCard `json:"data"`
}

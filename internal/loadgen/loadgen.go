// Package loadgen drives concurrent OpenAI streaming requests and records
// what each stream received, token by token, with arrival times. The demo,
// the benchmarks and the end-to-end tests share it.
package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// Request is one completion request of a load.
type Request struct {
	Prompt      string
	MaxTokens   int
	Seed        *int64
	Temperature float64
	IgnoreEOS   bool
	// TokenIDs asks the engine for each event's token ids
	// ("return_token_ids", vLLM's): Stream.IDs then holds them.
	TokenIDs bool
	Header   http.Header // this request's own headers (after Config.Header)
}

// Stream is what one streamed request received.
type Stream struct {
	Index    int
	ID       string
	Text     string
	Pieces   []string    // text of each token event
	Arrivals []time.Time // arrival of each token event
	// IDs are the token ids the events carried (Request.TokenIDs), and
	// PieceIDs how many each event carried (parallel to Pieces).
	IDs          []int
	PieceIDs     []int
	Start        time.Time
	FinishReason string
	Usage        *Usage
	Done         int // number of [DONE] events
	Err          error
}

// Usage is the usage event's counts.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// Config says where and how to send.
type Config struct {
	BaseURL string // e.g. http://127.0.0.1:8000
	Model   string
	Client  *http.Client
	// Stagger spreads the start of the streams over this long.
	Stagger time.Duration
	// Header is sent with every request (e.g. a client's X-Request-Id).
	Header http.Header
}

// Run sends every request concurrently as a streaming completion with
// usage and returns the streams in request order.
func Run(ctx context.Context, cfg Config, reqs []Request) []Stream {
	client := cfg.Client
	if client == nil {
		client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: len(reqs) + 1, MaxConnsPerHost: 0}}
	}
	out := make([]Stream, len(reqs))
	var wg sync.WaitGroup
	for i := range reqs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if cfg.Stagger > 0 && len(reqs) > 1 {
				d := cfg.Stagger * time.Duration(i) / time.Duration(len(reqs))
				select {
				case <-ctx.Done():
				case <-time.After(d):
				}
			}
			out[i] = streamOne(ctx, client, cfg, reqs[i])
			out[i].Index = i
		}(i)
	}
	wg.Wait()
	return out
}

func streamOne(ctx context.Context, client *http.Client, cfg Config, r Request) Stream {
	s := Stream{Start: time.Now()}
	body := map[string]any{
		"model": cfg.Model, "prompt": r.Prompt, "max_tokens": r.MaxTokens, "stream": true,
		"temperature": r.Temperature, "ignore_eos": r.IgnoreEOS,
		"stream_options": map[string]bool{"include_usage": true},
	}
	if r.Seed != nil {
		body["seed"] = *r.Seed
	}
	if r.TokenIDs {
		body["return_token_ids"] = true
	}
	b, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, cfg.BaseURL+"/v1/completions", bytes.NewReader(b))
	if err != nil {
		s.Err = err
		return s
	}
	for k, vs := range cfg.Header {
		req.Header[k] = vs
	}
	for k, vs := range r.Header {
		req.Header[k] = vs
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		s.Err = err
		return s
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		var msg bytes.Buffer
		_, _ = msg.ReadFrom(resp.Body)
		s.Err = fmt.Errorf("HTTP %d: %s", resp.StatusCode, strings.TrimSpace(msg.String()))
		return s
	}
	err = ReadEvents(resp.Body, func(data []byte) error {
		if string(data) == "[DONE]" {
			s.Done++
			return nil
		}
		var ev struct {
			ID      string `json:"id"`
			Choices []struct {
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
				TokenIDs     []int   `json:"token_ids"`
			} `json:"choices"`
			Usage *Usage `json:"usage"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return fmt.Errorf("bad event %q: %w", data, err)
		}
		if ev.Error != nil {
			return fmt.Errorf("error event: %s", ev.Error.Message)
		}
		s.ID = ev.ID
		if ev.Usage != nil {
			s.Usage = ev.Usage
		}
		for _, c := range ev.Choices {
			s.IDs = append(s.IDs, c.TokenIDs...)
			s.PieceIDs = append(s.PieceIDs, len(c.TokenIDs))
			s.Pieces = append(s.Pieces, c.Text)
			s.Arrivals = append(s.Arrivals, time.Now())
			s.Text += c.Text
			if c.FinishReason != nil {
				s.FinishReason = *c.FinishReason
			}
		}
		return nil
	})
	if err != nil {
		s.Err = err
	} else if s.Done != 1 {
		s.Err = fmt.Errorf("stream ended with %d [DONE] events", s.Done)
	}
	return s
}

// ReadEvents calls fn with the data of each SSE event in r.
func ReadEvents(r interface{ Read([]byte) (int, error) }, fn func(data []byte) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte("data: ")) {
			continue
		}
		if err := fn(line[len("data: "):]); err != nil {
			return err
		}
	}
	return sc.Err()
}

// Summary aggregates a load's streams.
type Summary struct {
	Streams      int
	Failed       int
	Tokens       int
	Wall         time.Duration
	TokensPerSec float64
	TTFTp50      time.Duration
	GapP50       time.Duration
	GapP99       time.Duration
	GapMax       time.Duration
}

// Summarize computes the summary of streams that ran over wall.
func Summarize(streams []Stream, wall time.Duration) Summary {
	s := Summary{Streams: len(streams), Wall: wall}
	var ttft, gaps []time.Duration
	for _, st := range streams {
		if st.Err != nil {
			s.Failed++
		}
		s.Tokens += len(st.Arrivals)
		if len(st.Arrivals) > 0 {
			ttft = append(ttft, st.Arrivals[0].Sub(st.Start))
		}
		for i := 1; i < len(st.Arrivals); i++ {
			gaps = append(gaps, st.Arrivals[i].Sub(st.Arrivals[i-1]))
		}
	}
	if wall > 0 {
		s.TokensPerSec = float64(s.Tokens) / wall.Seconds()
	}
	s.TTFTp50 = Percentile(ttft, 0.5)
	s.GapP50 = Percentile(gaps, 0.5)
	s.GapP99 = Percentile(gaps, 0.99)
	s.GapMax = Percentile(gaps, 1)
	return s
}

// Percentile returns the q-quantile (nearest rank) of ds; it sorts ds.
func Percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	i := int(q*float64(len(ds))+0.5) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}

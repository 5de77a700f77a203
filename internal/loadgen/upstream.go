package loadgen

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// TickUpstream is a minimal OpenAI-compatible streaming server for proxy
// benchmarks: like an engine, one step loop emits one token event to every
// open stream each interval; each event carries the time it was written
// ("sent_ns"), so a client measures per-token delivery latency through any
// proxy in front of it. It serves /health and /v1/models so a vhi agent can
// register it as a routing-only engine.
//
// With Spread, each stream instead ticks on its own timer at a random phase,
// so events arrive evenly rather than in one burst per step: that isolates
// the per-event cost of a proxy from the queueing a burst causes.
type TickUpstream struct {
	Model    string
	Interval time.Duration
	Spread   bool

	mu      sync.Mutex
	streams map[chan struct{}]struct{}
	stop    chan struct{}
}

// NewTickUpstream starts the step loop.
func NewTickUpstream(model string, interval time.Duration, spread bool) *TickUpstream {
	u := &TickUpstream{Model: model, Interval: interval, Spread: spread, streams: map[chan struct{}]struct{}{}, stop: make(chan struct{})}
	if !spread {
		go u.loop()
	}
	return u
}

// Close stops the step loop.
func (u *TickUpstream) Close() { close(u.stop) }

var _ http.Handler = (*TickUpstream)(nil)

func (u *TickUpstream) loop() {
	t := time.NewTicker(u.Interval)
	defer t.Stop()
	for {
		select {
		case <-u.stop:
			return
		case <-t.C:
		}
		u.mu.Lock()
		for ch := range u.streams {
			select {
			case ch <- struct{}{}:
			default: // that stream is behind; it catches up on its next write
			}
		}
		u.mu.Unlock()
	}
}

// ServeHTTP implements http.Handler.
func (u *TickUpstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		return
	case "/v1/models":
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","owned_by":"bench","root":%q,"max_model_len":100000}]}`, u.Model, u.Model)
		return
	case "/v1/completions", "/v1/chat/completions":
	default:
		http.NotFound(w, r)
		return
	}
	var req struct {
		MaxTokens int `json:"max_tokens"`
	}
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.MaxTokens < 1 {
		http.Error(w, `{"error":{"message":"bad request","type":"BadRequestError","param":null,"code":400}}`, http.StatusBadRequest)
		return
	}
	id := r.Header.Get("X-Request-Id")
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.WriteHeader(http.StatusOK)
	fl := w.(http.Flusher)
	var ch <-chan struct{}
	if u.Spread {
		time.Sleep(time.Duration(rand.Int64N(int64(u.Interval))))
		tk := time.NewTicker(u.Interval)
		defer tk.Stop()
		ticks := make(chan struct{})
		go func() {
			for {
				select {
				case <-r.Context().Done():
					return
				case <-tk.C:
					select {
					case ticks <- struct{}{}:
					case <-r.Context().Done():
						return
					}
				}
			}
		}()
		ch = ticks
	} else {
		step := make(chan struct{}, 1)
		u.mu.Lock()
		u.streams[step] = struct{}{}
		u.mu.Unlock()
		defer func() {
			u.mu.Lock()
			delete(u.streams, step)
			u.mu.Unlock()
		}()
		ch = step
	}
	prefix := []byte(`data: {"id":"cmpl-` + id + `","object":"text_completion","created":0,"model":"` + u.Model + `","choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":`)
	buf := make([]byte, 0, 256)
	for i := 0; i < req.MaxTokens; i++ {
		select {
		case <-r.Context().Done():
			return
		case <-ch:
		}
		finish := "null"
		if i == req.MaxTokens-1 {
			finish = `"length"`
		}
		buf = append(buf[:0], prefix...)
		buf = append(buf, finish...)
		buf = append(buf, `,"stop_reason":null}],"sent_ns":`...)
		buf = strconv.AppendInt(buf, time.Now().UnixNano(), 10)
		buf = append(buf, "}\n\n"...)
		if _, err := w.Write(buf); err != nil {
			return
		}
		fl.Flush()
	}
	_, _ = w.Write([]byte("data: [DONE]\n\n"))
	fl.Flush()
}

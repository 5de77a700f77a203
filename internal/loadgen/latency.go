package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// LatencyResult is what a latency run measured.
type LatencyResult struct {
	Streams   int
	Completed int
	Tokens    int
	Wall      time.Duration
	Latencies []time.Duration // per token: arrival − the upstream's sent_ns
	Errors    []error
}

// TokensPerSec is the delivered token rate.
func (r LatencyResult) TokensPerSec() float64 { return float64(r.Tokens) / r.Wall.Seconds() }

// RunLatency opens n streams of tokens tokens each against url
// (…/v1/completions) and records each token's delivery latency from the
// sent_ns the TickUpstream stamps. Streams start spread over ramp.
func RunLatency(ctx context.Context, url, model string, n, tokens int, ramp time.Duration) LatencyResult {
	tr := &http.Transport{MaxIdleConnsPerHost: n, DisableCompression: true,
		DialContext: (&net.Dialer{Timeout: 10 * time.Second}).DialContext}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	body := []byte(fmt.Sprintf(`{"model":%q,"prompt":"bench","max_tokens":%d,"stream":true}`, model, tokens))
	res := LatencyResult{Streams: n}
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			if ramp > 0 {
				time.Sleep(ramp * time.Duration(i) / time.Duration(n))
			}
			lat, err := latencyStream(ctx, client, url, body)
			mu.Lock()
			defer mu.Unlock()
			res.Latencies = append(res.Latencies, lat...)
			res.Tokens += len(lat)
			if err != nil {
				res.Errors = append(res.Errors, err)
			} else {
				res.Completed++
			}
		}(i)
	}
	wg.Wait()
	res.Wall = time.Since(start)
	return res
}

var sentKey = []byte(`"sent_ns":`)

func latencyStream(ctx context.Context, client *http.Client, url string, body []byte) ([]time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP %d", resp.StatusCode)
	}
	var out []time.Duration
	sc := bufio.NewScanner(resp.Body)
	done := false
	for sc.Scan() {
		line := sc.Bytes()
		now := time.Now()
		if bytes.Equal(line, []byte("data: [DONE]")) {
			done = true
			continue
		}
		i := bytes.Index(line, sentKey)
		if i < 0 {
			continue
		}
		rest := line[i+len(sentKey):]
		j := bytes.IndexByte(rest, '}')
		if j < 0 {
			continue
		}
		sent, err := strconv.ParseInt(string(rest[:j]), 10, 64)
		if err != nil {
			return out, err
		}
		out = append(out, now.Sub(time.Unix(0, sent)))
	}
	if err := sc.Err(); err != nil {
		return out, err
	}
	if !done {
		return out, fmt.Errorf("stream ended without [DONE]")
	}
	return out, nil
}

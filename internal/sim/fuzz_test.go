package sim

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// hookOps are the hook calls a fuzz input can make, one per line: the
// line's first byte picks the call, the rest is its body. (retire waits
// for requests to finish, and this engine takes no steps: it is left out.)
var hookOps = []struct{ method, path string }{
	{http.MethodPost, hooks.PathAllocate},
	{http.MethodPost, hooks.PathInstall},
	{http.MethodPost, hooks.PathPause},
	{http.MethodPost, hooks.PathResume},
	{http.MethodPost, hooks.PathExport},
	{http.MethodPost, hooks.PathAbort},
	{http.MethodGet, hooks.PathChanges + "?since="},
	{http.MethodGet, hooks.PathRequests},
	{http.MethodGet, "/vllm_hi/engine/requests/r/stream?from="},
}

// FuzzHooks sends sequences of arbitrary hook calls to an engine: none
// panics, every answer is JSON with a status below 500 (or a stream), and
// every block stays either free or owned by a request — a refused or
// malformed call leaks nothing.
func FuzzHooks(f *testing.F) {
	c := testConfig(f)
	c.NumBlocks = 64
	c.MaxModelLen = 128
	e, err := NewEngine(c, zap.NewNop())
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(e.Close)
	h := NewServer(e, zap.NewNop()).Handler()
	state := `{"request_id":"r","prompt_token_ids":[5,6,7],"output_token_ids":[8],"num_computed_tokens":3,` +
		`"sampling_params":{"temperature":1,"top_p":1,"seed":1,"max_tokens":9},"output_text":"x","text_offsets":[1],"response":{"kind":"completion"}}`
	for _, seed := range []string{
		"\x00{\"requests\":[{\"request_id\":\"r\",\"num_tokens\":20}]}\n\x01{\"requests\":[" + state + "],\"resume\":true}\n\x02{\"request_ids\":[\"r\"]}\n\x04{\"request_ids\":[\"r\"]}",
		// More computed tokens than the reservation holds (this panicked
		// the handler and left the engine half-installed).
		"\x00{\"requests\":[{\"request_id\":\"r\",\"num_tokens\":4}]}\n\x01{\"requests\":[" +
			bytesReplace(bytesReplace(state, `"num_computed_tokens":3`, `"num_computed_tokens":20`), `[5,6,7]`, `[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]`) + "]}",
		"\x00{\"requests\":[{\"request_id\":\"r\",\"num_tokens\":20}]}\n\x01{\"requests\":[" + bytesReplace(state, `"text_offsets":[1]`, `"text_offsets":[9]`) + "],\"resume\":true}\n\x081",
		"\x00{\"requests\":[{\"request_id\":\"r\",\"num_tokens\":20},{\"request_id\":\"r\",\"num_tokens\":20}]}",
		"\x05{\"request_ids\":[\"nope\"],\"ignore_missing\":true}\n\x0618446744073709551615\n\x07",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		for _, line := range bytes.Split(in, []byte("\n")) {
			if len(line) == 0 {
				continue
			}
			op := hookOps[int(line[0])%len(hookOps)]
			body := line[1:]
			path := op.path
			var rd *bytes.Reader
			if op.method == http.MethodGet {
				path += string(body)
				rd = bytes.NewReader(nil)
			} else {
				rd = bytes.NewReader(body)
			}
			req, err := http.NewRequest(op.method, "http://sim"+path, rd)
			if err != nil {
				continue // not a URL
			}
			req.Header.Set("Content-Type", "application/json")
			ctx, cancel := context.WithCancel(context.Background())
			if op.path == hooks.PathAttach || bytes.HasPrefix([]byte(op.path), []byte("/vllm_hi/engine/requests/r/stream")) {
				cancel() // a stream would follow the request for ever
			}
			w := httptest.NewRecorder()
			func() {
				defer func() {
					if p := recover(); p != nil && p != http.ErrAbortHandler {
						t.Fatalf("%s %s %q panicked: %v", op.method, path, body, p)
					}
				}()
				h.ServeHTTP(w, req.WithContext(ctx))
			}()
			cancel()
			if w.Code >= 500 && w.Code != http.StatusInsufficientStorage {
				t.Fatalf("%s %s %q: %d %s", op.method, path, body, w.Code, w.Body)
			}
			checkBlocks(t, e)
		}
		// Clean up for the next input: nothing may stay held.
		e.lock()
		var ids []string
		for id := range e.requests {
			ids = append(ids, id)
		}
		e.mu.Unlock()
		if len(ids) > 0 {
			if _, err := e.Abort(context.Background(), hooks.AbortRequest{RequestIDs: ids, Silent: true}); err != nil {
				t.Fatal(err)
			}
		}
		e.lock()
		free, total := e.pool.numFree(), e.pool.total()
		e.done = map[string]*request{}
		e.mu.Unlock()
		if free != total {
			t.Fatalf("%d of %d blocks free after every request was aborted: blocks leaked", free, total)
		}
	})
}

// checkBlocks: every block is free or held by exactly one live request.
func checkBlocks(t *testing.T, e *Engine) {
	t.Helper()
	e.lock()
	defer e.mu.Unlock()
	held := 0
	for _, r := range e.requests {
		held += len(r.blocks)
	}
	if held+e.pool.numFree() != e.pool.total() {
		t.Fatalf("%d blocks held by requests + %d free != %d", held, e.pool.numFree(), e.pool.total())
	}
}

func bytesReplace(s, old, new string) string {
	return string(bytes.Replace([]byte(s), []byte(old), []byte(new), 1))
}

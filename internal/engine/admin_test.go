package engine

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// The admin client sends what vLLM's routes take and reads their answers
// the way vLLM gives them, its bearer token included.
func TestAdminRoutes(t *testing.T) {
	var seen []string
	scaling := false
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer tok" {
			http.Error(w, "no token", http.StatusUnauthorized)
			return
		}
		body, _ := io.ReadAll(r.Body)
		seen = append(seen, r.Method+" "+r.URL.RequestURI()+" "+string(body))
		switch r.URL.Path {
		case "/is_sleeping":
			_, _ = io.WriteString(w, `{"is_sleeping":true}`)
		case "/is_scaling_elastic_ep":
			if scaling {
				http.Error(w, `{"error":"The model is currently scaling"}`, http.StatusServiceUnavailable)
				return
			}
			_, _ = io.WriteString(w, `{"is_scaling_elastic_ep":false}`)
		case "/v1/completions":
			_, _ = io.WriteString(w, `{"choices":[{"text":" Paris"}]}`)
		case "/sleep":
			http.Error(w, "sleep mode is off", http.StatusBadRequest)
		default:
			_, _ = io.WriteString(w, `{}`)
		}
	}))
	defer srv.Close()
	a := NewAdmin(srv.URL+"/", "m", "tok", nil)
	ctx := context.Background()
	if err := a.WakeUp(ctx, "weights", "kv_cache"); err != nil {
		t.Fatal(err)
	}
	if err := a.ReloadWeights(ctx); err != nil {
		t.Fatal(err)
	}
	if s, err := a.IsSleeping(ctx); err != nil || !s {
		t.Fatalf("is sleeping: %v %v", s, err)
	}
	if out, err := a.Probe(ctx, "The capital of France is"); err != nil || out != " Paris" {
		t.Fatalf("probe: %q %v", out, err)
	}
	if err := a.ScaleElasticEP(ctx, 4, 0); err != nil {
		t.Fatal(err)
	}
	if st, err := a.IsScalingElasticEP(ctx); err != nil || st != ScalingServing {
		t.Fatalf("scaling state %v %v, want serving", st, err)
	}
	scaling = true
	if st, err := a.IsScalingElasticEP(ctx); err != nil || st != ScalingCommitting {
		t.Fatalf("scaling state %v %v, want committing", st, err)
	}
	if err := a.Sleep(ctx, 1); err == nil || !strings.Contains(err.Error(), "400 sleep mode is off") {
		t.Fatalf("a refused sleep: %v", err)
	}
	want := []string{
		"POST /wake_up?tags=weights&tags=kv_cache ",
		`POST /collective_rpc {"method":"reload_weights"}`,
		"GET /is_sleeping ",
		`POST /v1/completions {"max_tokens":8,"model":"m","prompt":"The capital of France is","seed":0,"temperature":0}`,
		`POST /scale_elastic_ep {"drain_timeout":1,"new_data_parallel_size":4}`,
		"POST /is_scaling_elastic_ep ",
		"POST /is_scaling_elastic_ep ",
		"POST /sleep?level=1 ",
	}
	if strings.Join(seen, "\n") != strings.Join(want, "\n") {
		t.Fatalf("requests:\n%s\nwant:\n%s", strings.Join(seen, "\n"), strings.Join(want, "\n"))
	}
	// An engine that cannot be asked is neither serving nor scaling.
	gone := NewAdmin("http://127.0.0.1:1", "m", "", &http.Client{Timeout: time.Second})
	if st, err := gone.IsScalingElasticEP(ctx); err == nil || st != ScalingUnknown {
		t.Fatalf("an unreachable engine: %v %v", st, err)
	}
}

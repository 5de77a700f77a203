package hostapi

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeHost answers like the Host: a migration that runs for three polls,
// the contract's error object for anything else.
func fakeHost(t *testing.T) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var polls atomic.Int32
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+PathMigrate, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer adm" {
			w.WriteHeader(http.StatusUnauthorized)
			_ = json.NewEncoder(w).Encode(ErrorBody{Error: ErrorDetail{Message: "admin token required", Type: "Unauthorized", Code: 401}})
			return
		}
		var req MigrateRequest
		if err := json.NewDecoder(r.Body).Decode(&req); err != nil || req.Src == "" {
			w.WriteHeader(http.StatusBadRequest)
			_ = json.NewEncoder(w).Encode(ErrorBody{Error: ErrorDetail{Message: "src_vllm_hi_id is required", Type: "BadRequestError", Code: 400}})
			return
		}
		_ = json.NewEncoder(w).Encode(MigrateAnswer{ID: "mig-1"})
	})
	mux.HandleFunc("GET /vllm_hi/migration/{id}/status", func(w http.ResponseWriter, r *http.Request) {
		if r.PathValue("id") != "mig-1" {
			http.Error(w, "plain text, not JSON", http.StatusNotFound)
			return
		}
		st := MigrationStatus{ID: "mig-1", State: StateRunning}
		if polls.Add(1) >= 3 {
			st.State = StateSucceeded
		}
		_ = json.NewEncoder(w).Encode(st)
	})
	mux.HandleFunc("GET /vllm_hi/instances/{id}", func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(Instance{ID: r.PathValue("id")})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, &polls
}

func TestMigrateAndWait(t *testing.T) {
	srv, polls := fakeHost(t)
	c, err := New(srv.URL, Options{AdminToken: "adm"})
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	id, err := c.Migrate(context.Background(), MigrateRequest{Src: "a", Dst: "b"})
	if err != nil || id != "mig-1" {
		t.Fatalf("migrate: %q %v", id, err)
	}
	st, err := c.WaitMigration(context.Background(), id, time.Millisecond, func(s MigrationStatus) { seen = append(seen, s.State) })
	if err != nil || st.State != StateSucceeded || polls.Load() != 3 {
		t.Fatalf("wait: %+v %v after %d polls", st, err, polls.Load())
	}
	if strings.Join(seen, ",") != "running,running,succeeded" {
		t.Fatalf("progress saw %v", seen)
	}
}

func TestErrorsCarryTheContractsObject(t *testing.T) {
	srv, _ := fakeHost(t)
	anon, _ := New(srv.URL, Options{})
	_, err := anon.Migrate(context.Background(), MigrateRequest{Src: "a", Dst: "b"})
	var e *Error
	if !errors.As(err, &e) || e.Status != 401 || e.Type != "Unauthorized" || e.Message != "admin token required" {
		t.Fatalf("without a token: %#v", err)
	}
	c, _ := New(srv.URL, Options{AdminToken: "adm"})
	if _, err := c.Migrate(context.Background(), MigrateRequest{}); !IsStatus(err, 400) {
		t.Fatalf("a bad request: %v", err)
	}
	// An answer that is not the contract's JSON keeps its text.
	_, err = c.Migration(context.Background(), "nope")
	if !errors.As(err, &e) || e.Status != 404 || e.Message != "plain text, not JSON" {
		t.Fatalf("404: %#v", err)
	}
	if !IsStatus(fmtWrap(err), 404) {
		t.Fatal("IsStatus does not see through wrapping")
	}
}

func fmtWrap(err error) error { return errors.Join(errors.New("context"), err) }

func TestWaitHasADeadline(t *testing.T) {
	srv, _ := fakeHost(t)
	c, _ := New(srv.URL, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	st, err := c.WaitMigration(ctx, "mig-1", time.Hour, nil)
	if err == nil && st.State == StateRunning {
		t.Fatal("a cancelled wait reported a running migration as its end")
	}
}

func TestIDsAreEscaped(t *testing.T) {
	srv, _ := fakeHost(t)
	c, _ := New(srv.URL, Options{})
	in, err := c.Instance(context.Background(), "a b/c")
	if err != nil || in.ID != "a b/c" {
		t.Fatalf("%+v %v", in, err)
	}
}

func TestNewRefusesBadURLs(t *testing.T) {
	for _, u := range []string{"ftp://h:1", "http://", "://x"} {
		if _, err := New(u, Options{}); err == nil {
			t.Errorf("New(%q) accepted", u)
		}
	}
	c, err := New("127.0.0.1:8002/", Options{})
	if err != nil || c.Base() != "http://127.0.0.1:8002" {
		t.Fatalf("%v %v", c, err)
	}
}

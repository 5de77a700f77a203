package errdefs

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Every kind survives a trip through gRPC with its message, and maps to
// the HTTP status the contract gives it.
func TestKindsRoundTrip(t *testing.T) {
	for _, k := range kinds {
		err := fmt.Errorf("prepare the target: %w", Newf(k, "instance %s said no", "b"))
		if Kind(err) != k {
			t.Errorf("%v: Kind says %v", k, Kind(err))
		}
		back := FromGRPC(ToGRPC(err))
		if !errors.Is(back, k) || back.Error() != "prepare the target: instance b said no" {
			t.Errorf("%v through gRPC: %v (%v)", k, back, Kind(back))
		}
		if HTTPStatus(err) == 0 || Type(HTTPStatus(err)) == "" {
			t.Errorf("%v: no HTTP status", k)
		}
	}
	for kind, want := range map[error]int{ErrInvalidArgument: 400, ErrNotFound: 404, ErrConflict: 409, ErrUpstream: 502, ErrUnavailable: 503} {
		if got := HTTPStatus(New(kind, "x")); got != want {
			t.Errorf("%v: %d, want %d", kind, got, want)
		}
	}
}

// The outermost kind wins: a refusal that wraps an engine's "not found"
// is a conflict, and still says what it wraps.
func TestOutermostKind(t *testing.T) {
	inner := New(ErrNotFound, "no such request")
	err := fmt.Errorf("start: %w", Newf(ErrConflict, "prepare: %w", inner))
	if Kind(err) != ErrConflict || !errors.Is(err, ErrNotFound) || !errors.Is(err, inner) {
		t.Fatalf("%v: kind %v", err, Kind(err))
	}
	if err.Error() != "start: prepare: no such request" {
		t.Fatal(err)
	}
}

func TestFromOutside(t *testing.T) {
	if Kind(errors.New("plain")) != ErrInternal || Kind(nil) != nil {
		t.Fatal("plain errors are internal, nil is nil")
	}
	if Kind(fmt.Errorf("x: %w", context.DeadlineExceeded)) != ErrDeadlineExceeded {
		t.Fatal("a context deadline")
	}
	if err := FromGRPC(status.Error(codes.FailedPrecondition, "busy")); !IsConflict(err) || err.Error() != "busy" {
		t.Fatalf("%v", err)
	}
	if err := FromGRPC(status.Error(codes.Code(99), "odd")); !errors.Is(err, ErrUpstream) {
		t.Fatalf("an unknown code: %v", err)
	}
	plain := errors.New("not a status")
	if FromGRPC(plain) != plain || FromGRPC(nil) != nil || ToGRPC(nil) != nil {
		t.Fatal("non-status errors pass through")
	}
	s := status.Error(codes.NotFound, "kept")
	if ToGRPC(s) != s {
		t.Fatal("a status passes through ToGRPC")
	}
	for st, kind := range map[int]error{400: ErrInvalidArgument, 404: ErrNotFound, 409: ErrConflict, 507: ErrResourceExhausted, 503: ErrUnavailable, 500: ErrUpstream} {
		if FromHTTP(st) != kind {
			t.Errorf("HTTP %d: %v", st, FromHTTP(st))
		}
	}
	if HTTPStatus(New(FromHTTP(http.StatusInsufficientStorage), "full")) != http.StatusInsufficientStorage {
		t.Fatal("507 round trip")
	}
}

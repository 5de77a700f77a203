// Package errdefs is vllm-hi's one error vocabulary. A component says what
// kind of failure it met by wrapping one of the kinds below; each edge
// translates kinds exactly once — to gRPC codes where an agent or the
// Host's registry answers (ToGRPC, the server interceptor), back from
// them where the Host calls an agent (FromGRPC, the client interceptor),
// and to HTTP statuses and OpenAI error types where the REST APIs answer
// (HTTPStatus, Type) or an engine's hook answer is read (FromHTTP).
// In between, code asks errors.Is(err, errdefs.ErrNotFound).
package errdefs

import (
	"context"
	"errors"
	"fmt"
)

// The kinds.
var (
	ErrInvalidArgument   = errors.New("invalid argument")
	ErrNotFound          = errors.New("not found")
	ErrAlreadyExists     = errors.New("already exists")
	ErrConflict          = errors.New("conflict") // busy, or in the wrong role or state
	ErrResourceExhausted = errors.New("resource exhausted")
	ErrUnauthenticated   = errors.New("unauthenticated")
	ErrPermissionDenied  = errors.New("permission denied")
	ErrUnavailable       = errors.New("unavailable")
	ErrDeadlineExceeded  = errors.New("deadline exceeded")
	// ErrAborted: a transfer was cut or refused mid-way.
	ErrAborted = errors.New("aborted")
	// ErrDataLoss: memory does not hold what it should (the integrity
	// check found a difference).
	ErrDataLoss = errors.New("data loss")
	// ErrUpstream: an agent or engine failed in a way it did not classify
	// (the Host answers 502).
	ErrUpstream = errors.New("upstream failure")
	ErrInternal = errors.New("internal error")
)

// kinds in the order Kind tries them.
var kinds = []error{ErrInvalidArgument, ErrNotFound, ErrAlreadyExists, ErrConflict, ErrResourceExhausted,
	ErrUnauthenticated, ErrPermissionDenied, ErrUnavailable, ErrDeadlineExceeded, ErrAborted, ErrDataLoss,
	ErrUpstream, ErrInternal}

// kindError is a message of a kind: its text is the message alone (what an
// operator reads), and errors.Is sees the kind (and what %w wrapped).
type kindError struct {
	kind    error
	msg     string
	wrapped error
}

func (e *kindError) Error() string { return e.msg }
func (e *kindError) Unwrap() []error {
	if e.wrapped == nil {
		return []error{e.kind}
	}
	return []error{e.kind, e.wrapped}
}

// New returns an error of kind whose message is msg.
func New(kind error, msg string) error { return &kindError{kind: kind, msg: msg} }

// Newf returns an error of kind with a formatted message; what %w wraps
// stays visible to errors.Is and errors.As, but the error's kind is kind.
func Newf(kind error, format string, a ...any) error {
	err := fmt.Errorf(format, a...)
	return &kindError{kind: kind, msg: err.Error(), wrapped: errors.Unwrap(err)}
}

// Kind returns err's kind: one of the kinds above, context errors counted
// as ErrDeadlineExceeded (a deadline) or ErrUnavailable (a cancellation),
// ErrInternal for anything else, nil for nil.
func Kind(err error) error {
	if err == nil {
		return nil
	}
	var ke *kindError
	if errors.As(err, &ke) { // the outermost kind given
		return ke.kind
	}
	for _, k := range kinds {
		if errors.Is(err, k) {
			return k
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return ErrDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return ErrUnavailable
	}
	return ErrInternal
}

// IsNotFound reports whether err is of kind ErrNotFound.
func IsNotFound(err error) bool { return errors.Is(err, ErrNotFound) }

// IsConflict reports whether err is of kind ErrConflict.
func IsConflict(err error) bool { return errors.Is(err, ErrConflict) }

// IsResourceExhausted reports whether err is of kind ErrResourceExhausted.
func IsResourceExhausted(err error) bool { return errors.Is(err, ErrResourceExhausted) }

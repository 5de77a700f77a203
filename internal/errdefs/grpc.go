package errdefs

import (
	"context"
	"errors"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var toCode = map[error]codes.Code{
	ErrInvalidArgument:   codes.InvalidArgument,
	ErrNotFound:          codes.NotFound,
	ErrAlreadyExists:     codes.AlreadyExists,
	ErrConflict:          codes.FailedPrecondition,
	ErrResourceExhausted: codes.ResourceExhausted,
	ErrUnauthenticated:   codes.Unauthenticated,
	ErrPermissionDenied:  codes.PermissionDenied,
	ErrUnavailable:       codes.Unavailable,
	ErrDeadlineExceeded:  codes.DeadlineExceeded,
	ErrAborted:           codes.Aborted,
	ErrDataLoss:          codes.DataLoss,
	ErrUpstream:          codes.Unknown,
	ErrInternal:          codes.Internal,
}

// fromCode is toCode backwards, plus the codes no kind sends.
var fromCode = map[codes.Code]error{
	codes.InvalidArgument:    ErrInvalidArgument,
	codes.OutOfRange:         ErrInvalidArgument,
	codes.NotFound:           ErrNotFound,
	codes.AlreadyExists:      ErrAlreadyExists,
	codes.FailedPrecondition: ErrConflict,
	codes.ResourceExhausted:  ErrResourceExhausted,
	codes.Unauthenticated:    ErrUnauthenticated,
	codes.PermissionDenied:   ErrPermissionDenied,
	codes.Unavailable:        ErrUnavailable,
	codes.Canceled:           ErrUnavailable,
	codes.DeadlineExceeded:   ErrDeadlineExceeded,
	codes.Aborted:            ErrAborted,
	codes.DataLoss:           ErrDataLoss,
	codes.Internal:           ErrInternal,
	codes.Unimplemented:      ErrInternal,
}

// ToGRPC is err as a gRPC status (a status passes through).
func ToGRPC(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	return status.Error(toCode[Kind(err)], err.Error())
}

// FromGRPC is a gRPC status as an error of its kind carrying the status's
// message alone; other errors pass through.
func FromGRPC(err error) error {
	s, ok := status.FromError(err)
	if err == nil || !ok {
		return err
	}
	kind, ok := fromCode[s.Code()]
	if !ok {
		kind = ErrUpstream
	}
	return New(kind, s.Message())
}

// UnaryServerInterceptor translates every handler's error to a status.
func UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		resp, err := h(ctx, req)
		return resp, ToGRPC(err)
	}
}

// UnaryClientInterceptor translates every call's status back to a kind.
func UnaryClientInterceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			// The caller's own deadline: say so, whatever the transport said.
			return New(ErrDeadlineExceeded, "timed out: "+status.Convert(err).Message())
		}
		return FromGRPC(err)
	}
}

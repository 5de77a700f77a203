package errdefs

import "net/http"

var toHTTP = map[error]int{
	ErrInvalidArgument:   http.StatusBadRequest,
	ErrNotFound:          http.StatusNotFound,
	ErrAlreadyExists:     http.StatusConflict,
	ErrConflict:          http.StatusConflict,
	ErrResourceExhausted: http.StatusInsufficientStorage,
	ErrUnauthenticated:   http.StatusUnauthorized,
	ErrPermissionDenied:  http.StatusForbidden,
	ErrUnavailable:       http.StatusServiceUnavailable,
	ErrDeadlineExceeded:  http.StatusGatewayTimeout,
	ErrAborted:           http.StatusConflict,
	ErrDataLoss:          http.StatusInternalServerError,
	ErrUpstream:          http.StatusBadGateway,
	ErrInternal:          http.StatusInternalServerError,
}

// OpenAI-style error types by status, as vLLM names them.
var types = map[int]string{
	http.StatusBadRequest:          "BadRequestError",
	http.StatusUnauthorized:        "AuthenticationError",
	http.StatusForbidden:           "PermissionDeniedError",
	http.StatusNotFound:            "NotFoundError",
	http.StatusConflict:            "ConflictError",
	http.StatusInsufficientStorage: "InsufficientCapacityError",
	http.StatusServiceUnavailable:  "ServiceUnavailableError",
	http.StatusGatewayTimeout:      "GatewayTimeoutError",
	http.StatusBadGateway:          "BadGatewayError",
	http.StatusInternalServerError: "InternalServerError",
}

// HTTPStatus is the status a REST API answers err with.
func HTTPStatus(err error) int {
	if err == nil {
		return http.StatusOK
	}
	return toHTTP[Kind(err)]
}

// Type is the OpenAI-style error type of a status.
func Type(status int) string {
	if t, ok := types[status]; ok {
		return t
	}
	if status >= 500 {
		return "InternalServerError"
	}
	return "BadRequestError"
}

// FromHTTP is the kind of an engine's non-2xx answer: the status the
// hooks contract gives each failure (docs/engine-hooks.md).
func FromHTTP(status int) error {
	switch status {
	case http.StatusBadRequest, http.StatusUnprocessableEntity, http.StatusRequestEntityTooLarge:
		return ErrInvalidArgument
	case http.StatusUnauthorized:
		return ErrUnauthenticated
	case http.StatusForbidden:
		return ErrPermissionDenied
	case http.StatusNotFound, http.StatusMethodNotAllowed:
		return ErrNotFound
	case http.StatusConflict:
		return ErrConflict
	case http.StatusInsufficientStorage:
		return ErrResourceExhausted
	case http.StatusServiceUnavailable, http.StatusTooManyRequests:
		return ErrUnavailable
	case http.StatusGatewayTimeout, http.StatusRequestTimeout:
		return ErrDeadlineExceeded
	}
	return ErrUpstream
}

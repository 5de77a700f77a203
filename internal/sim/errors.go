package sim

import (
	"errors"
	"fmt"
	"net/http"
)

// Error is an engine error with the HTTP status and OpenAI error type it is
// reported with.
type Error struct {
	Status  int
	Type    string
	Param   string
	Message string
}

func (e *Error) Error() string { return e.Message }

func badRequest(param, format string, a ...any) error {
	return &Error{Status: http.StatusBadRequest, Type: "BadRequestError", Param: param, Message: fmt.Sprintf(format, a...)}
}

func notFound(param, format string, a ...any) error {
	return &Error{Status: http.StatusNotFound, Type: "NotFoundError", Param: param, Message: fmt.Sprintf(format, a...)}
}

func conflict(format string, a ...any) error {
	return &Error{Status: http.StatusConflict, Type: "ConflictError", Message: fmt.Sprintf(format, a...)}
}

func insufficient(format string, a ...any) error {
	return &Error{Status: http.StatusInsufficientStorage, Type: "InsufficientCapacityError", Message: fmt.Sprintf(format, a...)}
}

func unavailable(format string, a ...any) error {
	return &Error{Status: http.StatusServiceUnavailable, Type: "ServiceUnavailableError", Message: fmt.Sprintf(format, a...)}
}

// asError maps any error to an *Error (500 when it is not one).
func asError(err error) *Error {
	var e *Error
	if errors.As(err, &e) {
		return e
	}
	return &Error{Status: http.StatusInternalServerError, Type: "InternalServerError", Message: err.Error()}
}

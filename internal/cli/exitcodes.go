package cli

import (
	"context"
	"errors"
	"net"
	"net/url"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// Exit codes by cause: a script can tell a typo from a Host that is down
// from a refusal from an operation that ran and failed. Every command's
// error is translated here once, at the CLI's edge.
const (
	exitFailed      = 1 // the operation ran and did not succeed (a migration aborted, a drain failed), or any other error
	exitUsage       = 2 // the command line or its input is wrong (unknown flag, missing argument, a 400 from the Host)
	exitUnreachable = 3 // the Host (or the engine) could not be reached, or did not answer in time (its 503, 504)
	exitNotFound    = 4 // what the command names does not exist (404)
	exitConflict    = 5 // the Host refused in the state it is in (409: busy, the last active instance, …)
	exitDenied      = 6 // the credential is missing or wrong (401, 403)
)

// usageError marks an error in the command line itself.
type usageError struct{ err error }

func (e usageError) Error() string { return e.err.Error() }
func (e usageError) Unwrap() error { return e.err }

// exitCode is the exit code err calls for.
func exitCode(err error) int {
	var ee exitError
	var ue usageError
	var he *hostapi.Error
	var ne net.Error
	var ue2 *url.Error
	switch {
	case errors.As(err, &ee):
		return ee.code
	case errors.As(err, &ue):
		return exitUsage
	case errors.As(err, &he):
		// The Host's answer, by the project's one error vocabulary.
		switch k := errdefs.FromHTTP(he.Status); {
		case errors.Is(k, errdefs.ErrInvalidArgument):
			return exitUsage
		case errors.Is(k, errdefs.ErrNotFound):
			return exitNotFound
		case errors.Is(k, errdefs.ErrConflict):
			return exitConflict
		case errors.Is(k, errdefs.ErrUnauthenticated), errors.Is(k, errdefs.ErrPermissionDenied):
			return exitDenied
		case errors.Is(k, errdefs.ErrUnavailable), errors.Is(k, errdefs.ErrDeadlineExceeded):
			return exitUnreachable
		}
		return exitFailed
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne), errors.As(err, &ue2):
		return exitUnreachable
	}
	return exitFailed
}

// markUsage makes every command's argument and flag errors usage errors.
func markUsage(cmd *cobra.Command) {
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	if args := cmd.Args; args != nil {
		cmd.Args = func(c *cobra.Command, a []string) error {
			if err := args(c, a); err != nil {
				return usageError{err}
			}
			return nil
		}
	}
	for _, c := range cmd.Commands() {
		markUsage(c)
	}
}

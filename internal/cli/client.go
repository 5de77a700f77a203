package cli

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/credentials"
)

// hostClientFlags are the flags every operator command shares.
type hostClientFlags struct {
	url       string
	output    string
	tokenFile string
	caFile    string
}

func (h *hostClientFlags) add(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&h.url, "host", envDefault("VLLM_HI_HOST_URL", "http://127.0.0.1:8002"), "the Host's URL [VLLM_HI_HOST_URL]")
	f.StringVarP(&h.output, "output", "o", "table", "output: table or json (the lists vhi migrations, drains and scales: yaml too)")
	f.StringVar(&h.tokenFile, "admin-token-file", envDefault("VLLM_HI_ADMIN_TOKEN_FILE", ""),
		"file holding the admin token, for changes [VLLM_HI_ADMIN_TOKEN_FILE] (default: the local Host's admin-token)")
	f.StringVar(&h.caFile, "tls-ca-file", envDefault("VLLM_HI_TLS_CA_FILE", ""), "verify an https Host with this CA [VLLM_HI_TLS_CA_FILE]")
}

// client returns the typed Host client. changes: the command changes
// something, so the admin token is required (reads send it when known).
func (h *hostClientFlags) client(changes bool, timeout time.Duration) (*hostapi.Client, error) {
	tok, err := credentials.Resolve(h.tokenFile, credentials.AdminTokenFile, "--admin-token-file", changes)
	if err != nil {
		return nil, err
	}
	o := hostapi.Options{AdminToken: tok, Timeout: timeout}
	if h.caFile != "" {
		if o.TLS, err = (credentials.TLSFiles{CAFile: h.caFile}).Client(); err != nil {
			return nil, err
		}
	}
	return hostapi.New(h.url, o)
}

// call runs one client call with the command's deadline.
func (h *hostClientFlags) call(cmd *cobra.Command, changes bool, timeout time.Duration, f func(context.Context, *hostapi.Client) error) error {
	c, err := h.client(changes, timeout)
	if err != nil {
		return h.fail(err)
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
	defer cancel()
	return h.fail(f(ctx, c))
}

// jsonError is printed as the contract's error object on stdout (-o json):
// scripts parse one JSON document whatever happened.
type jsonError struct{ err error }

func (e jsonError) Error() string { return e.err.Error() }
func (e jsonError) Unwrap() error { return e.err }

// fail wraps err for the chosen output format.
func (h *hostClientFlags) fail(err error) error {
	if err == nil || h.output != "json" {
		return err
	}
	var je jsonError
	if errors.As(err, &je) {
		return err
	}
	return jsonError{err}
}

// errorJSON is the contract's error shape for a CLI error: the Host's own
// error when it refused, else a CLIError.
func errorJSON(err error) []byte {
	e := hostapi.ErrorDetail{Message: err.Error(), Type: "CLIError", Code: 1}
	var he *hostapi.Error
	if errors.As(err, &he) {
		e.Message, e.Type, e.Code = he.Message, he.Type, he.Status
	}
	var ee exitError
	if errors.As(err, &ee) && he == nil {
		e.Code = ee.code
	}
	b, _ := json.Marshal(hostapi.ErrorBody{Error: e})
	return b
}

// printJSON writes v indented, as every -o json answer is.
func printJSON(cmd *cobra.Command, v any) error {
	enc := json.NewEncoder(cmd.OutOrStdout())
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// completeInstances completes an instance id from the Host's list (shell
// completion: vhi completion bash|zsh|fish), each with its role and
// lifecycle; nothing when the Host cannot be reached in a second.
func (h *hostClientFlags) completeInstances(cmd *cobra.Command, _ []string, toComplete string) ([]cobra.Completion, cobra.ShellCompDirective) {
	c, err := h.client(false, time.Second)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), time.Second)
	defer cancel()
	list, err := c.Instances(ctx)
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	var out []cobra.Completion
	for _, i := range list {
		if strings.HasPrefix(i.ID, toComplete) {
			out = append(out, cobra.CompletionWithDesc(i.ID, i.Role+", "+i.Lifecycle+", "+i.ServedModelName))
		}
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}

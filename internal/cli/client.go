package cli

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/spf13/cobra"

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
	f.StringVarP(&h.output, "output", "o", "table", "output: table or json")
	f.StringVar(&h.tokenFile, "admin-token-file", envDefault("VLLM_HI_ADMIN_TOKEN_FILE", ""),
		"file holding the admin token, for changes [VLLM_HI_ADMIN_TOKEN_FILE] (default: the local Host's admin-token)")
	f.StringVar(&h.caFile, "tls-ca-file", envDefault("VLLM_HI_TLS_CA_FILE", ""), "verify an https Host with this CA [VLLM_HI_TLS_CA_FILE]")
}

func (h *hostClientFlags) base() string {
	u := strings.TrimRight(h.url, "/")
	if !strings.Contains(u, "://") {
		u = "http://" + u
	}
	return u
}

// hostError is the Host's answer to a request it refused.
type hostError struct {
	status int
	typ    string
	msg    string
}

func (e *hostError) Error() string { return fmt.Sprintf("the Host answered %d: %s", e.status, e.msg) }

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

// errorJSON is the contract's error shape for a CLI error.
func errorJSON(err error) []byte {
	e := struct {
		Message string `json:"message"`
		Type    string `json:"type"`
		Code    int    `json:"code"`
	}{Message: err.Error(), Type: "CLIError", Code: 1}
	var he *hostError
	if errors.As(err, &he) {
		e.Message, e.Type, e.Code = he.msg, he.typ, he.status
	}
	var ee exitError
	if errors.As(err, &ee) && he == nil {
		e.Code = ee.code
	}
	b, _ := json.Marshal(map[string]any{"error": e})
	return b
}

func (h *hostClientFlags) httpClient(timeout time.Duration) (*http.Client, error) {
	c := &http.Client{Timeout: timeout}
	if h.caFile != "" {
		cfg, err := credentials.TLSFiles{CAFile: h.caFile}.Client()
		if err != nil {
			return nil, err
		}
		c.Transport = &http.Transport{TLSClientConfig: cfg}
	}
	return c, nil
}

// do sends a request to the Host (with the admin token when one is
// known: reads need none, changes do) and decodes a 200's body into out.
func (h *hostClientFlags) do(method, path string, in, out any, timeout time.Duration) error {
	var body io.Reader
	if in != nil {
		b, _ := json.Marshal(in)
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, h.base()+path, body)
	if err != nil {
		return err
	}
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	tok, err := tokenFromFlag(h.tokenFile, credentials.AdminTokenFile, "--admin-token-file", method != http.MethodGet)
	if err != nil {
		return err
	}
	if tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	c, err := h.httpClient(timeout)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("cannot reach the Host at %s: %w", h.base(), err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		typ, msg := hostErrorMessage(b)
		return &hostError{status: resp.StatusCode, typ: typ, msg: msg}
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(b, out)
}

// getJSON fetches path from the Host into out.
func (h *hostClientFlags) getJSON(path string, out any) error {
	return h.do(http.MethodGet, path, nil, out, 10*time.Second)
}

func (h *hostClientFlags) postJSON(path string, in, out any) error {
	return h.do(http.MethodPost, path, in, out, 60*time.Second)
}

func hostErrorMessage(b []byte) (typ, msg string) {
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
		return e.Error.Type, e.Error.Message
	}
	return "", strings.TrimSpace(string(b))
}

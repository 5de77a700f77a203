// Package credentials holds what vllm-hi's planes authenticate with:
// bearer tokens read from files (generated on first start when the
// operator names none), the Host's state directory they live in by
// default, and TLS configurations built from certificate files.
//
// Two credentials exist. The admin token guards the Host's REST
// mutations. The agent token is held by the Host, every agent and every
// engine's hooks: agents present it to register, the Host presents it to
// drive agents and to attach to engines' streams, agents present it to
// their engine's hooks. Neither is ever the other unless the operator
// makes it so (the contract's --agent-token-file default).
package credentials

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
)

// File names inside the data directory.
const (
	AdminTokenFile = "admin-token"
	AgentTokenFile = "agent-token"
)

// DefaultDataDir is the Host's state directory when --data-dir is not
// given: $XDG_STATE_HOME/vllm-hi, or ~/.local/state/vllm-hi when unset
// (for root too; the systemd unit passes /var/lib/vllm-hi).
func DefaultDataDir() string {
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "vllm-hi")
	}
	home, err := os.UserHomeDir()
	if err != nil || home == "" {
		return filepath.Join(os.TempDir(), "vllm-hi")
	}
	return filepath.Join(home, ".local", "state", "vllm-hi")
}

// ReadToken reads a token file (surrounding whitespace trimmed). A token
// file that any user of the machine may read is refused, as ssh refuses
// such keys: whoever reads it can act as its holder. (A group may read
// it: that is how a service account shares it.)
func ReadToken(path string) (string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("read token: %w", err)
	}
	if st.Mode().Perm()&0o004 != 0 {
		return "", fmt.Errorf("token file %s is readable by every user (mode %v): chmod 600 it", path, st.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("read token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", fmt.Errorf("token file %s is empty", path)
	}
	if strings.ContainsAny(tok, " \t\r\n") {
		return "", fmt.Errorf("token file %s holds more than one word", path)
	}
	return tok, nil
}

// EnsureToken reads the token at path, or creates the file (mode 0600, its
// directory 0700) with a new random token when it does not exist.
func EnsureToken(path string) (tok string, created bool, err error) {
	tok, err = ReadToken(path)
	if err == nil || !errors.Is(err, fs.ErrNotExist) {
		return tok, false, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return "", false, fmt.Errorf("create %s: %w", filepath.Dir(path), err)
	}
	tok = NewToken()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		if errors.Is(err, fs.ErrExist) { // another process made it first
			tok, err = ReadToken(path)
			return tok, false, err
		}
		return "", false, fmt.Errorf("create token file: %w", err)
	}
	if _, err := f.WriteString(tok + "\n"); err != nil {
		f.Close()
		return "", false, fmt.Errorf("write token file: %w", err)
	}
	return tok, true, f.Close()
}

// MinTokenLen is the shortest token the Host accepts from an operator's
// file: a guessable token is a credential anyone holds. Its own are 64.
const MinTokenLen = 32

// CheckStrength refuses a token shorter than MinTokenLen, naming its file
// and how to make a good one.
func CheckStrength(tok, path string) error {
	if len(tok) < MinTokenLen {
		return fmt.Errorf("token file %s holds %d bytes: the Host needs at least %d (make one with: openssl rand -hex 32 > %s)",
			path, len(tok), MinTokenLen, path)
	}
	return nil
}

// NewToken is 32 random bytes in hex.
func NewToken() string {
	var b [32]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Bearer extracts the token of an "Authorization: Bearer <token>" value.
// The scheme is case-insensitive (RFC 7235).
func Bearer(header string) (string, bool) {
	scheme, tok, ok := strings.Cut(strings.TrimSpace(header), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimSpace(tok)
	return tok, tok != ""
}

// Matches reports whether an Authorization header carries want, in
// constant time. An empty want matches nothing.
func Matches(header, want string) bool {
	got, ok := Bearer(header)
	if !ok || want == "" {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// Require wraps h so that requests without "Authorization: Bearer <token>"
// get a 401 in the given JSON shape. An empty token requires nothing.
func Require(token string, unauthorized func(w http.ResponseWriter), h http.Handler) http.Handler {
	if token == "" {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !Matches(r.Header.Get("Authorization"), token) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="vllm-hi"`)
			unauthorized(w)
			return
		}
		h.ServeHTTP(w, r)
	})
}

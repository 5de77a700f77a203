package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/credentials"
)

// The Host refuses an operator's token file with a weak token, naming the
// file and how to make a good one; one it generates itself is accepted.
func TestTheHostRefusesShortTokens(t *testing.T) {
	dir := t.TempDir()
	write := func(name, tok string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(tok+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	short, long := write("short", "change-me"), write("long", credentials.NewToken())
	for _, c := range []struct{ admin, agent, bad string }{{short, long, short}, {long, short, short}} {
		_, _, err := hostTokens(dir, c.admin, c.agent, zap.NewNop())
		if err == nil || !strings.Contains(err.Error(), c.bad) || !strings.Contains(err.Error(), "at least 32") {
			t.Errorf("admin %s, agent %s: %v", filepath.Base(c.admin), filepath.Base(c.agent), err)
		}
	}
	if _, _, err := hostTokens(dir, long, long, zap.NewNop()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := hostTokens(filepath.Join(dir, "state"), "", "", zap.NewNop()); err != nil {
		t.Fatalf("the Host's own tokens: %v", err)
	}
}

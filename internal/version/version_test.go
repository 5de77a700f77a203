package version

import (
	"strings"
	"testing"
)

// The link flags win; without them the build information speaks, and a
// build that recorded nothing still says something.
func TestVersionAndCommit(t *testing.T) {
	if Version() == "" || Commit() == "" || !strings.HasPrefix(GoVersion(), "go") {
		t.Fatalf("version %q, commit %q, go %q", Version(), Commit(), GoVersion())
	}
	version, commit = "1.2.3", "abc1234"
	defer func() { version, commit = "", "" }()
	if Version() != "1.2.3" || Commit() != "abc1234" {
		t.Fatalf("with link flags: %s %s", Version(), Commit())
	}
}

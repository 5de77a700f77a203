package bench

import (
	"io"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// The demo passes only when streams moved, all exact: a migration that
// moved nothing proves nothing, and used to print OK.
func TestDemoVerdict(t *testing.T) {
	ok := scenarioResult{Status: hostapi.MigrationStatus{State: hostapi.StateSucceeded, Migrated: 64}}
	if err := demoVerdict(io.Discard, ok, 64); err != nil {
		t.Fatal(err)
	}
	for name, res := range map[string]scenarioResult{
		"nothing moved": {Status: hostapi.MigrationStatus{State: hostapi.StateSucceeded, Migrated: 0}},
		"aborted":       {Status: hostapi.MigrationStatus{State: hostapi.StateAborted, Migrated: 64}},
		"a mismatch":    {Status: hostapi.MigrationStatus{State: hostapi.StateSucceeded, Migrated: 64}, Mismatches: []string{"stream 3 differs"}},
	} {
		if err := demoVerdict(io.Discard, res, 64); err == nil {
			t.Errorf("%s: the demo passed", name)
		}
	}
}

package bench

import (
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"
)

// A comparison goes on past a migration that aborted or moved a token
// wrong (each run of a GPU bench costs minutes of a lent machine), and
// stops at a run that proves nothing.
func TestAFailedRunDoesNotStopTheComparison(t *testing.T) {
	streams := make([]loadgen.Stream, 4)
	for _, c := range []struct {
		name string
		st   hostapi.MigrationStatus
		res  scenarioResult
		goOn bool
		err  string
	}{
		{"succeeded", hostapi.MigrationStatus{State: hostapi.StateSucceeded, Migrated: 4}, scenarioResult{Streams: streams}, true, ""},
		{"aborted", hostapi.MigrationStatus{State: hostapi.StateAborted, Error: "integrity check failed: 22 of 572"}, scenarioResult{Streams: streams}, true, "migration aborted with 0 mismatches: integrity check failed"},
		{"inexact", hostapi.MigrationStatus{State: hostapi.StateSucceeded, Migrated: 4}, scenarioResult{Streams: streams, Mismatches: []string{"s1"}}, true, "1 mismatches"},
		{"moved nothing", hostapi.MigrationStatus{State: hostapi.StateSucceeded}, scenarioResult{Streams: streams}, false, "moved no request"},
		{"nothing judged", hostapi.MigrationStatus{State: hostapi.StateSucceeded, Migrated: 4}, scenarioResult{Streams: streams, Unjudged: []string{"a", "b", "c", "d"}}, false, "not deterministic"},
	} {
		goOn, err := outcome(c.st, c.res)
		if goOn != c.goOn || (err == nil) != (c.err == "") || err != nil && !strings.Contains(err.Error(), c.err) {
			t.Errorf("%s: go on %v, %v; want %v, %q", c.name, goOn, err, c.goOn, c.err)
		}
	}
}

package framework

import "testing"

// The migration cases against a deployment in this process (with -race in
// CI: every component at once); test/e2e runs the same cases against the
// binaries.
func TestMigrationCasesInProcess(t *testing.T) {
	Run(t, InProcess, Cases())
}

// Package version carries the build's version, set with -ldflags at link
// time by the Makefile.
package version

import "runtime"

// Set by -ldflags "-X github.com/vllm-hi/vllm-hi/internal/version.Version=…".
var (
	Version = "0.1.0-dev"
	Commit  = "unknown"
)

// GoVersion is the Go toolchain the binary was built with.
func GoVersion() string { return runtime.Version() }

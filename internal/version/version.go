// Package version says which build this is: the version and commit the
// Makefile sets with -ldflags at link time, else what the Go toolchain
// recorded in the binary (the module version of a `go install …@vX`, the
// VCS revision of a build in a checkout), so that a plain `go build`
// says its commit too.
package version

import (
	"runtime"
	"runtime/debug"
)

// Set by -ldflags "-X github.com/vllm-hi/vllm-hi/internal/version.version=…"
// (and …version.commit=…); empty: read from the build information.
var (
	version string
	commit  string
)

const devVersion = "0.1.0-dev"

// Version is the build's version.
func Version() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return devVersion
}

// Commit is the build's commit ("unknown" when neither the link flags nor
// the toolchain recorded one); "+dirty" marks a build of a modified tree.
func Commit() string {
	if commit != "" {
		return commit
	}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "unknown"
	}
	rev, dirty := "", false
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			dirty = s.Value == "true"
		}
	}
	if rev == "" {
		return "unknown"
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if dirty {
		rev += "+dirty"
	}
	return rev
}

// GoVersion is the Go toolchain the binary was built with.
func GoVersion() string { return runtime.Version() }

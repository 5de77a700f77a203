// Package bench holds vhi's benchmarks (`vhi bench …`): each one starts
// what it measures (sims, Hosts, agents, or a deployment it is pointed
// at), loads it, and prints side-by-side figures for docs/benchmarks.md.
// Apart from the CLI, as etcd keeps its benchmark tool apart from
// etcdctl: the CLI needs only the Host's API, the benchmarks need the
// daemons' internals.
package bench

import "go.uber.org/zap"

// Options is what the benchmarks (and vhi demo) take from the root command.
type Options struct {
	// Logger builds the logger that the root command's --log-level and
	// --log-format ask for.
	Logger func() (*zap.Logger, error)
}

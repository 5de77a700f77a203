package agent

import (
	"fmt"
	"net"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
)

// hostAddrs reads --host: one Host's IP:PORT, or several, comma-separated
// (Hosts sharing a store: the one leading it serves, the others wait).
func hostAddrs(s string) ([]string, error) {
	var out []string
	for _, a := range strings.Split(s, ",") {
		a = strings.TrimSpace(a)
		if _, _, err := net.SplitHostPort(a); err != nil {
			return nil, fmt.Errorf("--host must be IP:PORT of the Host (several: comma-separated), got %q", s)
		}
		out = append(out, a)
	}
	return out, nil
}

// hostTarget is the gRPC target and resolver for the Hosts: one address
// as it is; several through a fixed list that gRPC's pick_first walks in
// order, connecting to the first that accepts — a Host waiting to lead
// does not listen yet — and walking it again when that one goes away.
func hostTarget(addrs []string) (string, []grpc.DialOption) {
	if len(addrs) == 1 {
		return addrs[0], nil
	}
	r := manual.NewBuilderWithScheme("vhi-hosts")
	state := resolver.State{}
	for _, a := range addrs {
		// ServerName: each Host's TLS certificate is checked against its
		// own name, not the list's.
		name, _, _ := net.SplitHostPort(a)
		state.Addresses = append(state.Addresses, resolver.Address{Addr: a, ServerName: name})
	}
	r.InitialState(state)
	return r.Scheme() + ":///hosts", []grpc.DialOption{grpc.WithResolvers(r)}
}

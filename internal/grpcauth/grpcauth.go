// Package grpcauth carries the admin token on gRPC calls between the Host
// and agents, and checks it.
package grpcauth

import (
	"context"
	"crypto/subtle"
	"strings"

	"google.golang.org/grpc/metadata"
)

// Token sends a bearer token as "authorization" metadata; an empty token
// sends nothing. It implements credentials.PerRPCCredentials.
type Token string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (t Token) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	if t == "" {
		return nil, nil
	}
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials; the
// control plane runs without TLS (terminate it in front when needed).
func (Token) RequireTransportSecurity() bool { return false }

// Check reports whether the incoming call carries want (constant time).
func Check(ctx context.Context, want string) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	var got string
	if v := md.Get("authorization"); len(v) > 0 {
		got = strings.TrimPrefix(v[0], "Bearer ")
	}
	return subtle.ConstantTimeCompare([]byte(got), []byte(want)) == 1
}

// Package grpcauth sets up the gRPC edges between the Host and agents:
// it carries the agent token on every call and checks it, and it
// translates errors at the edge, once (internal/errdefs). The Host's
// Registry and every agent's Agent service install the same server
// options; the Host and the agents dial each other with DialOptions.
package grpcauth

import (
	"context"
	"crypto/tls"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	vhicreds "github.com/vllm-hi/vllm-hi/internal/credentials"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// DialOptions dial a Host or an agent: TLS verified with tlsConfig (plain
// TCP when nil), the token on every call, and the answers' statuses
// turned back into errdefs kinds.
func DialOptions(token string, tlsConfig *tls.Config) []grpc.DialOption {
	transport := insecure.NewCredentials()
	if tlsConfig != nil {
		transport = credentials.NewTLS(tlsConfig)
	}
	return []grpc.DialOption{grpc.WithTransportCredentials(transport), grpc.WithPerRPCCredentials(Token(token)),
		grpc.WithChainUnaryInterceptor(errdefs.UnaryClientInterceptor())}
}

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

// RequireTransportSecurity implements credentials.PerRPCCredentials. The
// token travels over TLS when the deployment has certificates; without
// them over plain TCP (the threat model in docs/operations.md says what
// that exposes).
func (Token) RequireTransportSecurity() bool { return false }

// Check reports whether the incoming call carries want (constant time).
// An empty want matches nothing.
func Check(ctx context.Context, want string) bool {
	md, _ := metadata.FromIncomingContext(ctx)
	v := md.Get("authorization")
	return len(v) > 0 && vhicreds.Matches(v[0], want)
}

// ServerOptions are the interceptors that refuse every call, unary or
// streaming, without the token — and, with requireCert, without a
// verified TLS client certificate (mTLS on an address that also serves
// clients without one); refused is told the method of each refusal (for
// metrics). An empty token refuses nothing.
func ServerOptions(token string, requireCert bool, refused func(method string)) []grpc.ServerOption {
	deny := func(ctx context.Context, method string) error {
		if strings.HasPrefix(method, "/grpc.health.v1.Health/") {
			// Health says serving or not, nothing else: supervisors
			// (Kubernetes' gRPC probes) ask it without the agent token.
			return nil
		}
		ok := token == "" || Check(ctx, token)
		if ok && requireCert {
			p, _ := peer.FromContext(ctx)
			ti, isTLS := p.AuthInfo.(credentials.TLSInfo)
			if p == nil || !isTLS || len(ti.State.VerifiedChains) == 0 {
				if refused != nil {
					refused(method)
				}
				return status.Error(codes.Unauthenticated, "a verified TLS client certificate is required")
			}
		}
		if ok {
			return nil
		}
		if refused != nil {
			refused(method)
		}
		return status.Error(codes.Unauthenticated, "missing or wrong agent token")
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if err := deny(ctx, info.FullMethod); err != nil {
				return nil, err
			}
			return h(ctx, req)
		}, errdefs.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if err := deny(ss.Context(), info.FullMethod); err != nil {
				return err
			}
			return h(srv, ss)
		}),
	}
}

// Stop stops srv gracefully — in-flight calls finish — but waits at most
// timeout before cutting what is left (a retire call can wait minutes
// for an engine's requests).
func Stop(srv *grpc.Server, timeout time.Duration) {
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(timeout):
		srv.Stop()
	}
}

package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// An agent's health, as a supervisor asks it: GET /healthz on
// --health-listen (off by default) and the standard gRPC health service
// on its gRPC port. Healthy: registered with a Host, and its engine
// answered healthy at the last heartbeat. Until then both say what the
// agent is waiting for.

// Agent phases, for the health answers.
const (
	phaseWaitingForEngine = "waiting for the engine"
	phaseRegistering      = "registering with the Host"
	phaseRegistered       = "registered"
	phaseStopping         = "stopping"
)

// setPhase records what the agent is doing.
func (a *Agent) setPhase(p string) {
	a.mu.Lock()
	a.phase = p
	a.mu.Unlock()
	a.updateGRPCHealth()
}

// setEngineHealthy records the engine's health at the last heartbeat.
func (a *Agent) setEngineHealthy(ok bool) {
	a.mu.Lock()
	a.engineHealthy = ok
	a.mu.Unlock()
	a.updateGRPCHealth()
}

// healthState is the agent's health now: ok, and what it is doing.
func (a *Agent) healthState() (ok bool, body map[string]any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	ok = a.registered && a.engineHealthy && a.phase == phaseRegistered
	status := "ok"
	if !ok {
		status = "not ready"
	}
	return ok, map[string]any{"status": status, "phase": a.phase, "registered": a.registered,
		"engine_healthy": a.engineHealthy, "vllm_hi_id": a.cfg.ID, "engine_url": a.cfg.EngineURL}
}

func (a *Agent) updateGRPCHealth() {
	if a.health == nil {
		return
	}
	ok, _ := a.healthState()
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ok {
		st = healthpb.HealthCheckResponse_SERVING
	}
	a.health.SetServingStatus("", st)
}

// newHealthServer is the gRPC health service the agent's gRPC server
// registers.
func (a *Agent) newHealthServer() *health.Server {
	a.health = health.NewServer()
	a.updateGRPCHealth()
	return a.health
}

// serveHealthz serves GET /healthz on addr until ctx ends.
func (a *Agent) serveHealthz(ctx context.Context, addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("agent: --health-listen %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		ok, body := a.healthState()
		w.Header().Set("Content-Type", "application/json")
		if !ok {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		_ = json.NewEncoder(w).Encode(body)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Warn("the health endpoint stopped", zap.Error(err))
		}
	}()
	a.log.Info("serving health", zap.String("addr", ln.Addr().String()))
	return nil
}

// logWhileWaiting says, every every, what the agent waits for, until
// done is closed: an agent whose engine takes minutes to load is not
// silent meanwhile.
func (a *Agent) logWhileWaiting(what string, limit, every time.Duration, done <-chan struct{}) {
	start := time.Now()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-done:
			return
		case <-t.C:
			a.log.Info("still waiting", zap.String("for", what), zap.Duration("waited", time.Since(start).Round(time.Second)),
				zap.Duration("limit", limit))
		}
	}
}

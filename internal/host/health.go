package host

import (
	"net/http"
)

// Liveness and readiness, as a supervisor (Kubernetes' probes, a
// balancer's health check) asks them. /livez: the process answers.
// /readyz: it can do its work — its store is open (and, shared, still
// this Host's to lead) and it serves the agents' gRPC — so a Host whose
// store is gone is taken out of rotation before it exits. /health stays
// as it was (always 200: the first waves' clients use it).

func (h *Host) livez(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (h *Host) readyz(w http.ResponseWriter, _ *http.Request) {
	checks := map[string]string{"grpc": "ok", "store": "ok"}
	ready := true
	if !h.serving.Load() {
		checks["grpc"], ready = "not serving yet", false
	}
	if h.store == nil {
		checks["store"] = "none (nothing survives a restart)"
	} else {
		select {
		case <-h.store.Lost():
			checks["store"], ready = "lost: another Host leads the shared store", false
		default:
		}
	}
	status, code := "ok", http.StatusOK
	if !ready {
		status, code = "not ready", http.StatusServiceUnavailable
	}
	writeJSON(w, code, map[string]any{"status": status, "checks": checks})
}

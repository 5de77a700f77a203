package hooks

import (
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Hook names: how the Host asks an agent to relay a hook (the Hook RPC's
// name) and how the routes below are keyed.
const (
	HookLayout   = "layout"
	HookRequests = "requests"
	HookChanges  = "changes"
	HookPause    = "pause"
	HookResume   = "resume"
	HookExport   = "export"
	HookAllocate = "allocate"
	HookInstall  = "install"
	HookStage    = "stage"
	HookAbort    = "abort"
	HookStats    = "stats"
	HookRetire   = "retire"
	HookWake     = "wake"
	HookAttach   = "attach"
)

// Route is one hook as an engine serves it.
type Route struct {
	Name   string `json:"name"`
	Method string `json:"method"`
	Path   string `json:"path"`
	// Relayed: the agent's Hook RPC forwards the call as it is. Retire and
	// wake have RPCs of their own (the agent does more around them);
	// attach is a stream the Host reads from the engine directly.
	Relayed bool `json:"relayed"`
}

// Routes is every hook's route: the one table the agent's relay, the
// sim's server and the vLLM plugin's router (through routes.json, which
// TestRoutesFile keeps equal to it) are built from.
func Routes() []Route {
	return []Route{
		{HookLayout, http.MethodGet, PathLayout, true},
		{HookRequests, http.MethodGet, PathRequests, true},
		{HookChanges, http.MethodGet, PathChanges, true},
		{HookPause, http.MethodPost, PathPause, true},
		{HookResume, http.MethodPost, PathResume, true},
		{HookExport, http.MethodPost, PathExport, true},
		{HookAllocate, http.MethodPost, PathAllocate, true},
		{HookInstall, http.MethodPost, PathInstall, true},
		{HookStage, http.MethodPost, PathStage, true},
		{HookAbort, http.MethodPost, PathAbort, true},
		{HookStats, http.MethodGet, PathStats, true},
		{HookRetire, http.MethodPost, PathRetire, false},
		{HookWake, http.MethodPost, PathWake, false},
		{HookAttach, http.MethodGet, PathAttach, false},
	}
}

// RouteOf returns the named hook's route.
func RouteOf(name string) (Route, bool) {
	for _, r := range Routes() {
		if r.Name == name {
			return r, true
		}
	}
	return Route{}, false
}

// PreAttachPath is PathAttach for a request not installed yet: from the
// output index it will be installed at, waiting up to wait for it.
func PreAttachPath(requestID string, wait time.Duration) string {
	return strings.Replace(PathAttach, "{request_id}", url.PathEscape(requestID), 1) + "?from=-1&wait_ms=" + strconv.FormatInt(wait.Milliseconds(), 10)
}

// AttachCutPath is PathAttach for one request, from token index from,
// opening with the request's text from code point textFrom on: the text
// its client lacks when the Host's relay stopped reading the source early
// (an engine that derives the moved tokens' text serves it; see
// InstallResponse.VisibleText).
func AttachCutPath(requestID string, from, textFrom int) string {
	return AttachPath(requestID, from) + "&text_from=" + strconv.Itoa(textFrom)
}

// AttachPath is PathAttach for one request, from token index from.
func AttachPath(requestID string, from int) string {
	return strings.Replace(PathAttach, "{request_id}", url.PathEscape(requestID), 1) + "?from=" + strconv.Itoa(from)
}

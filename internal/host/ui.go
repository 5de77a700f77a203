package host

import (
	"embed"
	"io/fs"
	"net/http"
	"strings"

	"github.com/vllm-hi/vllm-hi/internal/proxy"
)

// The status page (GET /ui): the instances with their role, lifecycle,
// KV use and requests, and the migrations, drains and scale operations
// with their steps — the REST API read once a second by a page served
// from the binary, nothing fetched from elsewhere.

//go:embed ui
var uiFiles embed.FS

func (h *Host) uiHandler() http.Handler {
	sub, _ := fs.Sub(uiFiles, "ui")
	files := http.StripPrefix("/ui", http.FileServer(http.FS(sub)))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Only the page's own files, nothing inline or from elsewhere.
		w.Header().Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		files.ServeHTTP(w, r)
	})
}

// root sends a browser to the status page; anything else gets the
// contract's 404.
func (h *Host) root(w http.ResponseWriter, r *http.Request) {
	if strings.Contains(r.Header.Get("Accept"), "text/html") {
		http.Redirect(w, r, "/ui/", http.StatusFound)
		return
	}
	proxy.WriteError(w, http.StatusNotFound, "NotFoundError", "no such endpoint (the status page is /ui/)")
}

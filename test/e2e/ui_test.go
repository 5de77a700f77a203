package e2e

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// The status page in a real headless Chromium (Debian's, driven through
// chromedp): after a migration under load it shows both instances with
// their roles and lifecycle, and the migration with its steps; the page
// loads nothing from elsewhere. VHI_UPDATE_SCREENSHOT=1 writes the
// README's docs/images/ui.png from it.
func TestStatusPageInChromium(t *testing.T) {
	const chromium = "/usr/bin/chromium"
	if _, err := os.Stat(chromium); err != nil {
		if os.Getenv("VHI_REQUIRE_BROWSER") != "" {
			t.Fatalf("Chromium is required (make chromium): %v", err)
		}
		t.Skip("no Chromium here (make chromium installs it)")
	}
	d := deploy(t, 4096)
	reqs := load(16, 300)
	running := d.startLoad(reqs)
	time.Sleep(600 * time.Millisecond)
	st := d.waitMigration(t, hostapi.MigrateRequest{Src: "A", Dst: "B", Type: hostapi.PreserveSource})
	<-running
	if st.State != hostapi.StateSucceeded {
		t.Fatalf("the migration: %s %s", st.State, st.Error)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(chromium), chromedp.NoSandbox, chromedp.WindowSize(1400, 700))
	actx, cancel := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancel()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	// The first action starts the browser: no deadline on it (the
	// browser would live only as long), the waits after it have one.
	if err := chromedp.Do(ctx, chromedp.Navigate(d.hostURL+"/")); err != nil { // a browser at the root lands on the page
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 60*time.Second)
	defer wcancel()
	if err := chromedp.Do(wctx,
		chromedp.WaitVisible(chromedp.CSS(`#instances tr[data-id="B"]`)),
		chromedp.WaitVisible(chromedp.CSS(`#migrations tr[data-id="`+st.ID+`"]`)),
	); err != nil {
		t.Fatal(err)
	}
	instances, err := chromedp.Run(wctx, chromedp.Text(chromedp.CSS(`#instances tbody`)))
	if err != nil {
		t.Fatal(err)
	}
	migrations, err := chromedp.Run(wctx, chromedp.Text(chromedp.CSS(`#migrations tbody`)))
	if err != nil {
		t.Fatal(err)
	}
	shot, err := chromedp.Run(wctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"A", "B", "active", "standby", "TP1×PP1"} {
		if !strings.Contains(instances, w) {
			t.Errorf("the instances table lacks %q:\n%s", w, instances)
		}
	}
	for _, w := range []string{st.ID, "succeeded", "A → B", "final_round", "16/16", " MiB"} {
		if !strings.Contains(migrations, w) {
			t.Errorf("the migrations table lacks %q:\n%s", w, migrations)
		}
	}
	resp, err := http.Get(d.hostURL + "/ui/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if csp := resp.Header.Get("Content-Security-Policy"); !strings.HasPrefix(csp, "default-src 'self'") {
		t.Errorf("the page may load from elsewhere: Content-Security-Policy %q", csp)
	}
	if os.Getenv("VHI_UPDATE_SCREENSHOT") != "" {
		if err := os.WriteFile("../../docs/images/ui.png", shot, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

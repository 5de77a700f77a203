package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/errdefs"
)

// install relays an install hook's body (hooks.InstallRequest as JSON).
//
// Over HTTP alone the target's API server registers each moved stream and
// then asks its engine core to install the requests, and both halves run
// on the API server's event loop one after the other (with a migration's
// eight chunks, they queue behind each other there: 37–99 ms of waiting
// per chunk at 256 streams on the H200, docs/benchmarks.md). With a core
// channel that takes "install", the two halves go out at once: the engine
// core installs over the channel while the API server only registers the
// streams ("skip_engine_core"). Neither commits: the commit (resume) comes
// only after this answers, so no output can reach a stream before the API
// server is ready for it. If either half fails the install fails, and the
// Host's rollback aborts the reservations, which drops whatever either
// half kept.
func (c *Client) install(ctx context.Context, body []byte) ([]byte, error) {
	ch, err := c.coreChannel(ctx)
	if err != nil || ch == nil || !ch.Takes(hooks.HookInstall) {
		if err != nil {
			return nil, err
		}
		return c.Raw(ctx, http.MethodPost, hooks.PathInstall, body)
	}
	var head struct {
		Resume bool `json:"resume"`
	}
	trimmed := bytes.TrimSpace(body)
	if len(trimmed) < 2 || trimmed[0] != '{' || json.Unmarshal(trimmed, &head) != nil {
		return nil, fmt.Errorf("%w: an install's body is a JSON object", errdefs.ErrInvalidArgument)
	}
	if head.Resume {
		// Install and commit at once (no Host in between to wait for both
		// halves): the API server's own order, registration first.
		return c.Raw(ctx, http.MethodPost, hooks.PathInstall, body)
	}
	api := []byte(`{"skip_engine_core":true}`)
	if rest := bytes.TrimSpace(trimmed[1:]); len(rest) > 1 { // more than "}"
		api = append([]byte(`{"skip_engine_core":true,`), rest...)
	}
	if _, has := ctx.Deadline(); !has {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, defaultTimeout)
		defer cancel()
	}
	coreErr := make(chan error, 1)
	go func() {
		t, err := ch.Call(ctx, hooks.HookInstall, json.RawMessage(trimmed), nil)
		c.logCore(hooks.HookInstall, t, err)
		coreErr <- err
	}()
	out, err := c.Raw(ctx, http.MethodPost, hooks.PathInstall, api)
	cerr := <-coreErr
	switch {
	case err != nil:
		return nil, err
	case cerr != nil:
		return nil, fmt.Errorf("install in the engine core: %w", cerr)
	}
	return out, nil
}

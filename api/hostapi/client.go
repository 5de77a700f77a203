package hostapi

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/vllm-hi/vllm-hi/api/httpjson"
)

// Client talks to one Host's REST API.
type Client struct {
	base  string
	token string
	http  *http.Client
}

// Options configure a Client.
type Options struct {
	// AdminToken is sent as "Authorization: Bearer" (the REST API's
	// changes need it; reads do not).
	AdminToken string
	// TLS verifies an https Host (nil: the system roots).
	TLS *tls.Config
	// Timeout bounds one call whose context has no deadline (default 60 s).
	Timeout time.Duration
}

// New returns a client for the Host at base (http(s)://host:port, or
// host:port for http).
func New(base string, o Options) (*Client, error) {
	b := base
	if !strings.Contains(b, "://") {
		b = "http://" + b
	}
	b = strings.TrimRight(b, "/")
	u, err := url.Parse(b)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("host URL %q: want http(s)://host:port", base)
	}
	if o.Timeout <= 0 {
		o.Timeout = 60 * time.Second
	}
	tr := &http.Transport{Proxy: nil, TLSClientConfig: o.TLS, MaxIdleConnsPerHost: 8, IdleConnTimeout: 30 * time.Second}
	return &Client{base: b, token: o.AdminToken, http: &http.Client{Transport: tr, Timeout: o.Timeout}}, nil
}

// Base is the Host's base URL.
func (c *Client) Base() string { return c.base }

// Error is an answer of the Host other than 200: its status and the
// contract's error object.
type Error struct {
	Status  int
	Type    string
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("the Host answered %d: %s", e.Status, e.Message) }

// IsStatus reports whether err is the Host's answer with that status.
func IsStatus(err error, status int) bool {
	var e *Error
	return errors.As(err, &e) && e.Status == status
}

func path(p, id string) string { return strings.Replace(p, "{id}", url.PathEscape(id), 1) }

// do sends one request and decodes a 200's JSON body into out.
func (c *Client) do(ctx context.Context, method, p string, in, out any) error {
	var body []byte
	if in != nil {
		var err error
		if body, err = json.Marshal(in); err != nil {
			return err
		}
	}
	status, b, err := httpjson.Do(ctx, c.http, method, c.base+p, c.token, body, 64<<20)
	if err != nil {
		return fmt.Errorf("cannot reach the Host at %s: %w", c.base, err)
	}
	if status != http.StatusOK {
		e := &Error{Status: status, Message: strings.TrimSpace(string(b))}
		var eb ErrorBody
		if json.Unmarshal(b, &eb) == nil && eb.Error.Message != "" {
			e.Type, e.Message = eb.Error.Type, eb.Error.Message
		}
		return e
	}
	if out == nil {
		return nil
	}
	if err := json.Unmarshal(b, out); err != nil {
		return fmt.Errorf("the Host's answer to %s %s: %w", method, p, err)
	}
	return nil
}

// Status is GET /vllm_hi/status.
func (c *Client) Status(ctx context.Context) (out Status, err error) {
	return out, c.do(ctx, http.MethodGet, PathStatus, nil, &out)
}

// WaitInstances polls the status until the Host lists n instances or ctx
// ends.
func (c *Client) WaitInstances(ctx context.Context, n int) error {
	for {
		st, err := c.Status(ctx)
		if err == nil && st.InstanceCount == n {
			return nil
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = fmt.Errorf("the Host lists %d instances", st.InstanceCount)
			}
			return fmt.Errorf("waiting for %d instances: %w (%w)", n, ctx.Err(), err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Instances lists the instances.
func (c *Client) Instances(ctx context.Context) ([]Instance, error) {
	var out InstanceList
	err := c.do(ctx, http.MethodGet, PathInstances, nil, &out)
	return out.Instances, err
}

// Instance returns one instance.
func (c *Client) Instance(ctx context.Context, id string) (out Instance, err error) {
	return out, c.do(ctx, http.MethodGet, path(PathInstance, id), nil, &out)
}

// Wake brings a retired or sleeping engine back as a target.
func (c *Client) Wake(ctx context.Context, id string) (out Instance, err error) {
	return c.WakeWith(ctx, id, WakeRequest{})
}

// WakeWith is Wake with options: Active makes the woken instance active
// (it serves requests again) rather than standby.
func (c *Client) WakeWith(ctx context.Context, id string, req WakeRequest) (out Instance, err error) {
	return out, c.do(ctx, http.MethodPost, path(PathWake, id), req, &out)
}

// Drain moves every request off an instance by migration and retires it;
// it returns the drain's id at once.
func (c *Client) Drain(ctx context.Context, id string, req DrainRequest) (string, error) {
	var out DrainAnswer
	if err := c.do(ctx, http.MethodPost, path(PathDrain, id), req, &out); err != nil {
		return "", err
	}
	return out.ID, nil
}

// DrainStatus returns a drain's status.
func (c *Client) DrainStatus(ctx context.Context, id string) (out DrainStatus, err error) {
	return out, c.do(ctx, http.MethodGet, path(PathDrainStatus, id), nil, &out)
}

// Drains lists every drain, newest first.
func (c *Client) Drains(ctx context.Context) ([]DrainStatus, error) {
	var out DrainList
	err := c.do(ctx, http.MethodGet, PathDrains, nil, &out)
	return out.Drains, err
}

// Rebalance returns the balancer's settings and latest decisions.
func (c *Client) Rebalance(ctx context.Context) (out RebalanceStatus, err error) {
	return out, c.do(ctx, http.MethodGet, PathRebalance, nil, &out)
}

// WaitDrain polls a drain every interval (default 100 ms) until it ends
// or ctx does, calling progress (when not nil) with every status it reads.
func (c *Client) WaitDrain(ctx context.Context, id string, every time.Duration, progress func(DrainStatus)) (DrainStatus, error) {
	return wait(ctx, every, 100*time.Millisecond, func(ctx context.Context) (DrainStatus, error) { return c.DrainStatus(ctx, id) },
		DrainStatus.Ended, progress, func(st DrainStatus) string { return "drain " + id + " still " + st.State })
}

// Undrain routes to a drained instance again.
func (c *Client) Undrain(ctx context.Context, id string) (out Instance, err error) {
	return out, c.do(ctx, http.MethodPost, path(PathUndrain, id), struct{}{}, &out)
}

// Scale starts a scale operation and returns its id (the running one's,
// when the same target is being scaled to already).
func (c *Client) Scale(ctx context.Context, req ScaleRequest) (string, error) {
	var out ScaleAnswer
	if err := c.do(ctx, http.MethodPost, PathScale, req, &out); err != nil {
		return "", err
	}
	return out.ID, nil
}

// ScaleStatus returns a scale operation's status.
func (c *Client) ScaleStatus(ctx context.Context, id string) (out ScaleStatus, err error) {
	return out, c.do(ctx, http.MethodGet, path(PathScaleStatus, id), nil, &out)
}

// Scales lists the scale operations, newest first.
func (c *Client) Scales(ctx context.Context) ([]ScaleStatus, error) {
	var out ScaleList
	err := c.do(ctx, http.MethodGet, PathScales, nil, &out)
	return out.Scales, err
}

// Autoscale is the autoscaler's view and its latest decisions.
func (c *Client) Autoscale(ctx context.Context) (out AutoscaleStatus, err error) {
	return out, c.do(ctx, http.MethodGet, PathAutoscale, nil, &out)
}

// WaitScale polls a scale operation until it ends or ctx does.
func (c *Client) WaitScale(ctx context.Context, id string, every time.Duration, progress func(ScaleStatus)) (ScaleStatus, error) {
	return wait(ctx, every, 100*time.Millisecond, func(ctx context.Context) (ScaleStatus, error) { return c.ScaleStatus(ctx, id) },
		ScaleStatus.Ended, progress, func(st ScaleStatus) string { return "scale " + id + " still " + st.State })
}

// AdminState is every switched model's state.
func (c *Client) AdminState(ctx context.Context) (out AdminState, err error) {
	return out, c.do(ctx, http.MethodGet, PathAdminState, nil, &out)
}

// Switch wakes a switched model now (its group's awake model drained and
// put to sleep) and answers once it is awake.
func (c *Client) Switch(ctx context.Context, model string) (out SwitchResult, err error) {
	return out, c.do(ctx, http.MethodPost, strings.Replace(PathAdminSwitch, "{model}", url.PathEscape(model), 1), struct{}{}, &out)
}

// Prewarm wakes a switched model and keeps it awake for ttl.
func (c *Client) Prewarm(ctx context.Context, model string, ttl time.Duration) (out PrewarmResult, err error) {
	return out, c.do(ctx, http.MethodPost, PathAdminPrewarm, PrewarmRequest{Model: model, TTLS: ttl.Seconds()}, &out)
}

// Forget drops an instance whose agent is gone.
func (c *Client) Forget(ctx context.Context, id string) error {
	return c.do(ctx, http.MethodDelete, path(PathInstance, id), nil, nil)
}

// Migrate starts a migration and returns its id.
func (c *Client) Migrate(ctx context.Context, req MigrateRequest) (string, error) {
	var out MigrateAnswer
	if err := c.do(ctx, http.MethodPost, PathMigrate, req, &out); err != nil {
		return "", err
	}
	return out.ID, nil
}

// Migration returns a migration's status.
func (c *Client) Migration(ctx context.Context, id string) (out MigrationStatus, err error) {
	return out, c.do(ctx, http.MethodGet, path(PathMigrationStatus, id), nil, &out)
}

// Migrations lists every migration, newest first.
func (c *Client) Migrations(ctx context.Context) ([]MigrationStatus, error) {
	var out MigrationList
	err := c.do(ctx, http.MethodGet, PathMigrations, nil, &out)
	return out.Migrations, err
}

// WaitMigration polls a migration every interval (default 50 ms) until it
// ends or ctx does, calling progress (when not nil) with every status it
// reads.
func (c *Client) WaitMigration(ctx context.Context, id string, every time.Duration, progress func(MigrationStatus)) (MigrationStatus, error) {
	return wait(ctx, every, 50*time.Millisecond, func(ctx context.Context) (MigrationStatus, error) { return c.Migration(ctx, id) },
		MigrationStatus.Ended, progress, func(st MigrationStatus) string { return "migration " + id + " still " + st.State })
}

// wait polls get every interval (dflt when not positive) until ended says
// so or ctx ends, calling progress (when not nil) with every status read;
// still names the status for the error when ctx ends first.
func wait[S any](ctx context.Context, every, dflt time.Duration, get func(context.Context) (S, error), ended func(S) bool,
	progress func(S), still func(S) string) (S, error) {
	if every <= 0 {
		every = dflt
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		st, err := get(ctx)
		if err != nil {
			return st, err
		}
		if progress != nil {
			progress(st)
		}
		if ended(st) {
			return st, nil
		}
		select {
		case <-ctx.Done():
			return st, fmt.Errorf("%s: %w", still(st), ctx.Err())
		case <-t.C:
		}
	}
}

// MigrateAndWait starts a migration and waits for its end.
func (c *Client) MigrateAndWait(ctx context.Context, req MigrateRequest, every time.Duration) (MigrationStatus, error) {
	id, err := c.Migrate(ctx, req)
	if err != nil {
		return MigrationStatus{}, err
	}
	return c.WaitMigration(ctx, id, every, nil)
}

package cli

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

var update = flag.Bool("update", false, "rewrite docs/host-config.schema.json")

// Each cause has its exit code, whatever the command.
func TestExitCodesByCause(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	for _, c := range []struct {
		args []string
		want int
	}{
		{[]string{"drain"}, exitUsage},                                   // a missing argument
		{[]string{"instances", "--no-such-flag"}, exitUsage},             // an unknown flag
		{[]string{"migrations", "-o", "xml", "--host", down}, exitUsage}, // a format the list cannot write, before any call
		{[]string{"instances", "--host", down}, exitUnreachable},
		{[]string{"migrations", "--host", down}, exitUnreachable},
	} {
		root := NewRootCommand()
		root.SetArgs(c.args)
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		if got := exitCode(root.Execute()); got != c.want {
			t.Errorf("vhi %v: exit %d, want %d", c.args, got, c.want)
		}
	}
	for _, c := range []struct {
		err  error
		want int
	}{
		{&hostapi.Error{Status: 404}, exitNotFound},
		{&hostapi.Error{Status: 409}, exitConflict},
		{&hostapi.Error{Status: 400}, exitUsage},
		{&hostapi.Error{Status: 401}, exitDenied},
		{fmt.Errorf("drain: %w", &hostapi.Error{Status: 409}), exitConflict},
		{exitError{code: exitFailed, err: fmt.Errorf("migration aborted")}, exitFailed},
		{fmt.Errorf("something else"), exitFailed},
	} {
		if got := exitCode(c.err); got != c.want {
			t.Errorf("%v: exit %d, want %d", c.err, got, c.want)
		}
	}
}

// Instance ids complete from the Host's list, in arguments and flags.
func TestInstanceIDsComplete(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != hostapi.PathInstances {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(hostapi.InstanceList{Instances: []hostapi.Instance{
			{ID: "a-1", Role: "active", Lifecycle: "active", ServedModelName: "m"},
			{ID: "b-1", Role: "standby", Lifecycle: "standby", ServedModelName: "m"},
		}})
	}))
	defer srv.Close()
	for _, args := range [][]string{
		{"__complete", "drain", "--host", srv.URL, "a"},
		{"__complete", "migrate", "--host", srv.URL, "--src", "a"},
	} {
		root := NewRootCommand()
		root.SetArgs(args)
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&bytes.Buffer{})
		if err := root.Execute(); err != nil {
			t.Fatal(err)
		}
		if got := out.String(); !strings.Contains(got, "a-1\tactive, active, m") || strings.Contains(got, "b-1") {
			t.Errorf("vhi %v completes:\n%s", args[1:], got)
		}
	}
}

// vhi host --check says whether a configuration is valid without
// starting anything: 0 and what it sets, or 2 and what is wrong.
func TestHostCheck(t *testing.T) {
	dir := t.TempDir()
	good, bad := dir+"/good.yaml", dir+"/bad.yaml"
	_ = os.WriteFile(good, []byte("autoscale:\n  interval_s: 5\n"), 0o600)
	_ = os.WriteFile(bad, []byte("autoscale:\n  intervall_s: 5\n"), 0o600)
	for _, c := range []struct {
		args []string
		code int
		out  string
	}{
		{[]string{"host", "--check", "--config", good}, 0, "is valid"},
		{[]string{"host", "--check", "--config", bad}, exitUsage, ""},
		{[]string{"host", "--check", "--config", dir + "/none.yaml"}, exitUsage, ""},
		{[]string{"host", "--check", "--heartbeat-interval", "0s"}, exitUsage, ""},
		{[]string{"host", "--check", "--migration-pause-in-flight", "wait"}, 0, "are valid"},
		{[]string{"host", "--check", "--migration-pause-in-flight", "later"}, exitUsage, ""},
		{[]string{"host", "--config-schema"}, 0, `"$schema"`},
	} {
		root := NewRootCommand()
		root.SetArgs(c.args)
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		err := root.Execute()
		if code := map[bool]int{true: 0, false: exitCode(err)}[err == nil]; code != c.code || !strings.Contains(out.String(), c.out) {
			t.Errorf("vhi %v: exit %d (%v), output %q; want %d", c.args, code, err, out.String(), c.code)
		}
	}
}

// The file's host section sets any vhi host flag by its name and in its
// syntax; the command line wins; an unknown name or a bad value is
// refused (exit 2).
func TestHostSection(t *testing.T) {
	dir := t.TempDir()
	conf := dir + "/host.yaml"
	_ = os.WriteFile(conf, []byte("host:\n  migration-pause-lease: 4s\n  migration-tn: 3\n  access-log: false\n  listen: 127.0.0.1:9000\n"), 0o600)
	root := NewRootCommand()
	root.SetArgs([]string{"host", "--check", "--config", conf, "--listen", "127.0.0.1:9001"})
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"migration-pause-lease=4s", "migration-tn=3", "access-log=false", "the command line's instead of the file's: listen"} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("vhi host --check lacks %q:\n%s", w, out.String())
		}
	}
	for _, bad := range []string{"host:\n  no-such-flag: 1\n", "host:\n  migration-pause-lease: soon\n", "host:\n  config: other.yaml\n"} {
		_ = os.WriteFile(conf, []byte(bad), 0o600)
		root := NewRootCommand()
		root.SetArgs([]string{"host", "--check", "--config", conf})
		root.SetOut(&bytes.Buffer{})
		root.SetErr(&bytes.Buffer{})
		if code := exitCode(root.Execute()); code != exitUsage {
			t.Errorf("%q: exit %d, want %d", bad, code, exitUsage)
		}
	}
}

// The published schema is the one the Go types and vhi host's flags make
// (go test -update rewrites it).
func TestPublishedSchemaIsCurrent(t *testing.T) {
	root := NewRootCommand()
	root.SetArgs([]string{"host", "--config-schema"})
	var out bytes.Buffer
	root.SetOut(&out)
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	const path = "../../docs/host-config.schema.json"
	if *update {
		if err := os.WriteFile(path, out.Bytes(), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil || string(want) != out.String() {
		t.Fatalf("%s is not what the Go types and flags make (go test ./internal/cli -update): %v", path, err)
	}
	for _, w := range []string{`"targets"`, `"autoscale"`, `"host"`, `"migration-pause-lease"`, `"pattern"`} {
		if !strings.Contains(out.String(), w) {
			t.Errorf("the schema lacks %s", w)
		}
	}
}

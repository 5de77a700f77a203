// Package etcdtest runs a real etcd server (etcd's own embed package) in
// a test's process, for the shared store's tests: in process for
// internal/store, and for the Host processes of the end-to-end tests,
// which reach it over TCP as they would a deployed etcd.
package etcdtest

import (
	"fmt"
	"net"
	"net/url"
	"testing"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
)

// Start runs a one-member etcd until the test ends and returns its client
// endpoint (HOST:PORT).
func Start(t testing.TB) string {
	t.Helper()
	cfg := embed.NewConfig()
	cfg.Dir = t.TempDir()
	cfg.LogLevel = "fatal" // its shutdown logs every closed listener as an error
	// A test's etcd keeps nothing past the test: without an fsync per
	// write, a loaded disk does not stall it past the Hosts' leases.
	cfg.UnsafeNoFsync = true
	cu, pu := localURL(t), localURL(t)
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(30 * time.Second):
		t.Fatal("etcd did not start within 30 s")
	}
	return cu.Host
}

// localURL is http://127.0.0.1 on a port free now.
func localURL(t testing.TB) url.URL {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", l.Addr().(*net.TCPAddr).Port)}
}

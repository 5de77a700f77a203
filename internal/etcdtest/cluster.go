package etcdtest

import (
	"fmt"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	"go.etcd.io/etcd/server/v3/embed"
)

// TLS is a cluster's client TLS: the members serve it with CertFile and
// KeyFile and require client certificates issued by CAFile.
type TLS struct {
	CAFile, CertFile, KeyFile string
}

// Member is one member of a cluster Started by StartCluster.
type Member struct {
	Endpoint string // HOST:PORT of its client listener
	e        *embed.Etcd
	once     sync.Once
}

// Stop stops the member (as its machine going down would); the others
// keep a quorum while most members run.
func (m *Member) Stop() { m.once.Do(m.e.Close) }

// IsLeader says whether the member leads the cluster's raft.
func (m *Member) IsLeader() bool { return m.e.Server.Leader() == m.e.Server.MemberID() }

// StartCluster runs an n-member etcd in the test's process until the test
// ends, its clients served over TLS when tls is not nil (peers talk plain
// HTTP on the loopback), and returns its members once they have a leader.
func StartCluster(t testing.TB, n int, tls *TLS) []*Member {
	t.Helper()
	scheme := "http"
	if tls != nil {
		scheme = "https"
	}
	cfgs := make([]*embed.Config, n)
	var peers []string
	for i := range cfgs {
		cfg := embed.NewConfig()
		cfg.Name = fmt.Sprintf("m%d", i)
		cfg.Dir = t.TempDir()
		cfg.LogLevel = "fatal"
		cfg.UnsafeNoFsync = true // as Start's
		cu, pu := localURL(t), localURL(t)
		cu.Scheme = scheme
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{cu}, []url.URL{cu}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{pu}, []url.URL{pu}
		if tls != nil {
			cfg.ClientTLSInfo = transport.TLSInfo{CertFile: tls.CertFile, KeyFile: tls.KeyFile, TrustedCAFile: tls.CAFile, ClientCertAuth: true}
		}
		cfg.InitialClusterToken = "vllm-hi-test"
		peers = append(peers, cfg.Name+"="+pu.String())
		cfgs[i] = cfg
	}
	members := make([]*Member, n)
	for i, cfg := range cfgs {
		cfg.InitialCluster = strings.Join(peers, ",")
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			t.Fatal(err)
		}
		members[i] = &Member{Endpoint: cfg.ListenClientUrls[0].Host, e: e}
		t.Cleanup(members[i].Stop)
	}
	for _, m := range members {
		select {
		case <-m.e.Server.ReadyNotify():
		case <-time.After(30 * time.Second):
			t.Fatalf("etcd member %s was not ready within 30 s", m.Endpoint)
		}
	}
	return members
}

package store

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"
)

// EtcdOptions say where a shared store is and how this Host holds it.
type EtcdOptions struct {
	// Endpoints are the etcd members (HOST:PORT).
	Endpoints []string
	// Prefix is where every key goes (default /vllm-hi/): several
	// deployments can share one etcd.
	Prefix string
	TLS    *tls.Config // nil: plain
	// LeaseTTL is how long the leader's hold outlives it: another Host
	// takes over at most this long after the leader died (default 5 s).
	LeaseTTL time.Duration
	// OpTimeout bounds each read and write (default 5 s).
	OpTimeout time.Duration
	// ID and Address name this Host among those of the store (its
	// election key's value: what GET /vllm_hi/status lists).
	ID, Address string
	Log         *zap.Logger
}

// Member is one Host of a shared store.
type Member struct {
	ID       string    `json:"id"`
	Address  string    `json:"address"`
	Leader   bool      `json:"-"`
	LastSeen time.Time `json:"-"`
}

// Members lists the Hosts of the store — the leader, then those waiting
// to take over in the order they would — and when each one's lease was
// last renewed.
func (s *Etcd) Members(ctx context.Context) ([]Member, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	resp, err := s.cli.Get(ctx, s.prefix+"election/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	now := time.Now()
	out := make([]Member, 0, len(resp.Kvs))
	for i, kv := range resp.Kvs {
		var m Member
		if json.Unmarshal(kv.Value, &m) != nil {
			m.ID = string(kv.Value)
		}
		m.Leader = i == 0
		if ttl, err := s.cli.TimeToLive(ctx, clientv3.LeaseID(kv.Lease)); err == nil && ttl.TTL > 0 {
			// Renewed to its granted TTL, then counting down.
			m.LastSeen = now.Add(-time.Duration(ttl.GrantedTTL-ttl.TTL) * time.Second).UTC()
		}
		out = append(out, m)
	}
	return out, nil
}

// Etcd is the shared store: every Host of a deployment on one etcd, one
// of them leading (an etcd election under a lease). Only the leader
// writes — each write is a transaction that holds only while its
// election key is still the leader's — so a Host that lost its lease
// (partitioned, paused) cannot overwrite its successor's state; it learns
// so from Lost and stops.
type Etcd struct {
	cli *clientv3.Client
	// mu guards sess and election: a Host that follows takes a new lease
	// when its last one ended (Rejoin).
	mu        sync.Mutex
	sess      *concurrency.Session
	election  *concurrency.Election
	prefix    string
	timeout   time.Duration
	ttl       int // the lease's, in seconds
	endpoints []string
	me        Member
	log       *zap.Logger
	leading   chan struct{} // closed once this Host leads
	leadOnce  sync.Once
	lost      chan struct{} // closed when the lease this Host led under ended
	lostOnce  sync.Once
}

// ErrLeaseEnded is Campaign's answer when this Host's lease ended while it
// waited to lead (etcd stalled or unreachable past the lease): Rejoin
// takes a new one.
var ErrLeaseEnded = errors.New("this Host's lease on the shared store ended while it followed")

// ErrNotLeader is returned by a write of a Host that no longer leads.
var ErrNotLeader = errors.New("this Host does not lead the shared store (another Host does, or it took over)")

// ParseEtcdURL reads etcd://HOST:PORT[,HOST:PORT…] into endpoints.
func ParseEtcdURL(u string) ([]string, error) {
	rest, ok := strings.CutPrefix(u, "etcd://")
	if !ok || rest == "" {
		return nil, fmt.Errorf("--store %q: want bolt or etcd://HOST:PORT[,HOST:PORT…]", u)
	}
	var eps []string
	for _, ep := range strings.Split(strings.TrimSuffix(rest, "/"), ",") {
		if ep == "" || strings.ContainsAny(ep, "/?#@ ") {
			return nil, fmt.Errorf("--store %q: %q is not HOST:PORT", u, ep)
		}
		eps = append(eps, ep)
	}
	return eps, nil
}

// OpenEtcd connects to etcd and waits until this Host leads the store
// (another Host may lead it now: this one takes over when that one's
// lease ends), or until ctx ends.
func OpenEtcd(ctx context.Context, o EtcdOptions) (*Etcd, error) {
	s, err := ConnectEtcd(ctx, o)
	if err != nil {
		return nil, err
	}
	if err := s.Campaign(ctx); err != nil {
		s.Close()
		return nil, err
	}
	return s, nil
}

// ConnectEtcd connects to etcd and takes this Host's lease, without
// leading: the Host serves its clients' streams meanwhile and follows
// the leader's decisions (Watch…); Campaign makes it lead.
func ConnectEtcd(ctx context.Context, o EtcdOptions) (*Etcd, error) {
	if len(o.Endpoints) == 0 {
		return nil, errors.New("the shared store needs at least one etcd endpoint")
	}
	if o.Prefix == "" {
		o.Prefix = "/vllm-hi/"
	}
	if !strings.HasSuffix(o.Prefix, "/") {
		o.Prefix += "/"
	}
	if o.LeaseTTL <= 0 {
		o.LeaseTTL = 5 * time.Second
	}
	if o.OpTimeout <= 0 {
		o.OpTimeout = 5 * time.Second
	}
	log := o.Log
	if log == nil {
		log = zap.NewNop()
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: o.Endpoints, DialTimeout: o.OpTimeout, TLS: o.TLS,
		Logger: log.Named("etcd-client").WithOptions(zap.IncreaseLevel(zap.WarnLevel)), Context: ctx})
	if err != nil {
		return nil, fmt.Errorf("etcd %s: %w", strings.Join(o.Endpoints, ","), err)
	}
	s := &Etcd{cli: cli, prefix: o.Prefix, timeout: o.OpTimeout, endpoints: o.Endpoints, log: log, leading: make(chan struct{}), lost: make(chan struct{})}
	s.me = Member{ID: o.ID, Address: o.Address}
	// A first round trip, bounded: a wrong address or credential is said
	// at once, not as a wait for leadership.
	sctx, cancel := context.WithTimeout(ctx, o.OpTimeout)
	_, err = cli.Get(sctx, o.Prefix+"election", clientv3.WithCountOnly())
	cancel()
	if err != nil {
		cli.Close()
		return nil, fmt.Errorf("etcd %s: %w", strings.Join(o.Endpoints, ","), err)
	}
	s.ttl = max(1, int((o.LeaseTTL+time.Second-1)/time.Second))
	if s.sess, err = concurrency.NewSession(cli, concurrency.WithTTL(s.ttl), concurrency.WithContext(ctx)); err != nil {
		cli.Close()
		return nil, fmt.Errorf("etcd: a lease for this Host: %w", err)
	}
	s.election = concurrency.NewElection(s.sess, o.Prefix+"election")
	return s, nil
}

// session is this Host's lease and its place in the election now.
func (s *Etcd) session() (*concurrency.Session, *concurrency.Election) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sess, s.election
}

// Campaign waits until this Host leads the store, or ctx ends. Leading
// is closed then. A lease that ends meanwhile ends the wait
// (ErrLeaseEnded): a campaign won on a lease that is gone would lead
// with an election key etcd deleted.
func (s *Etcd) Campaign(ctx context.Context) error {
	sess, election := s.session()
	lctx, lcancel := context.WithTimeout(ctx, s.timeout)
	if leader, err := election.Leader(lctx); err == nil && len(leader.Kvs) > 0 {
		s.log.Info("another Host leads the shared store: this one follows it and takes over when its lease ends",
			zap.ByteString("leader", leader.Kvs[0].Value), zap.Int("lease_ttl_s", s.ttl))
	}
	lcancel()
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-sess.Done():
			cancel()
		case <-cctx.Done():
		}
	}()
	me, _ := json.Marshal(s.me)
	err := election.Campaign(cctx, string(me))
	select {
	case <-sess.Done():
		return ErrLeaseEnded
	default:
	}
	if err != nil {
		return fmt.Errorf("etcd: waiting to lead the shared store: %w", err)
	}
	s.leadOnce.Do(func() { close(s.leading) })
	go func() {
		<-sess.Done()
		s.lostOnce.Do(func() { close(s.lost) })
	}()
	s.log.Info("leading the shared store", zap.String("prefix", s.prefix), zap.Strings("endpoints", s.endpoints))
	return nil
}

// Rejoin gives a Host that follows a new lease after its last one ended
// (Campaign said ErrLeaseEnded): it goes on following and campaigns again
// instead of stopping — it decided nothing, so nothing of its can clash
// with the leader's. A Host that led cannot rejoin: another may have
// decided since its lease ended (Lost).
func (s *Etcd) Rejoin(ctx context.Context) error {
	if s.Leads() {
		return errors.New("a Host that led the shared store cannot take a new lease: it stops")
	}
	sess, err := concurrency.NewSession(s.cli, concurrency.WithTTL(s.ttl), concurrency.WithContext(ctx))
	if err != nil {
		return fmt.Errorf("etcd: a new lease for this Host: %w", err)
	}
	s.mu.Lock()
	old := s.sess
	s.sess, s.election = sess, concurrency.NewElection(sess, s.prefix+"election")
	s.mu.Unlock()
	_ = old.Close() // its lease is gone: this only stops its keep-alive
	s.log.Info("this Host took a new lease on the shared store and follows again", zap.Int("lease_ttl_s", s.ttl))
	return nil
}

// Leading is closed once this Host leads the store.
func (s *Etcd) Leading() <-chan struct{} { return s.leading }

// Leads reports whether this Host leads the store now (it won the
// election; a lease that ended since is Lost's to say).
func (s *Etcd) Leads() bool {
	select {
	case <-s.leading:
		return true
	default:
		return false
	}
}

// Me is this Host as the store's members list it.
func (s *Etcd) Me() Member { return s.me }

// Leader is the Host leading the store now (ok false: none).
func (s *Etcd) Leader(ctx context.Context) (m Member, ok bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	_, election := s.session()
	resp, err := election.Leader(ctx)
	if errors.Is(err, concurrency.ErrElectionNoLeader) {
		return Member{}, false, nil
	}
	if err != nil {
		return Member{}, false, fmt.Errorf("etcd: %w", err)
	}
	if len(resp.Kvs) == 0 {
		return Member{}, false, nil
	}
	if json.Unmarshal(resp.Kvs[0].Value, &m) != nil {
		m.ID = string(resp.Kvs[0].Value)
	}
	m.Leader = true
	return m, true, nil
}

// Resign gives the leadership up now: another Host takes over at once,
// and this Host's writes are refused from here (ErrNotLeader).
func (s *Etcd) Resign(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	_, election := s.session()
	return election.Resign(ctx)
}

// Lost implements Store: closed when the lease this Host led under ended
// (a Host that follows takes a new one: Rejoin).
func (s *Etcd) Lost() <-chan struct{} { return s.lost }

// Close gives the leadership up (another Host takes over at once) and
// disconnects.
func (s *Etcd) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	sess, election := s.session()
	if election != nil {
		_ = election.Resign(ctx)
	}
	if sess != nil {
		_ = sess.Close()
	}
	return s.cli.Close()
}

// write applies op while this Host still leads.
func (s *Etcd) write(op clientv3.Op) error {
	if !s.Leads() {
		return ErrNotLeader
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	_, election := s.session()
	leads := clientv3.Compare(clientv3.CreateRevision(election.Key()), "=", election.Rev())
	resp, err := s.cli.Txn(ctx).If(leads).Then(op).Commit()
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	if !resp.Succeeded {
		return ErrNotLeader
	}
	return nil
}

func (s *Etcd) put(kind, id string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return s.write(clientv3.OpPut(s.prefix+kind+"/"+id, string(b)))
}

func (s *Etcd) del(kind, id string) error {
	return s.write(clientv3.OpDelete(s.prefix + kind + "/" + id))
}

// list returns every value under kind, by id.
func (s *Etcd) list(kind string) (map[string][]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	dir := s.prefix + kind + "/"
	resp, err := s.cli.Get(ctx, dir, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("etcd: %w", err)
	}
	out := make(map[string][]byte, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[strings.TrimPrefix(string(kv.Key), dir)] = kv.Value
	}
	return out, nil
}

func listOf[T any](s *Etcd, kind string) ([]T, error) {
	vals, err := s.list(kind)
	if err != nil {
		return nil, err
	}
	out := make([]T, 0, len(vals))
	for id, v := range vals {
		var r T
		if err := json.Unmarshal(v, &r); err != nil {
			return nil, fmt.Errorf("etcd: %s/%s: %w", kind, id, err)
		}
		out = append(out, r)
	}
	return out, nil
}

const (
	kindInstances  = "instances"
	kindMigrations = "migrations"
	kindLaunched   = "launched"
)

// PutInstance implements Store.
func (s *Etcd) PutInstance(i Instance) error { return s.put(kindInstances, i.ID, i) }

// DeleteInstance implements Store.
func (s *Etcd) DeleteInstance(id string) error { return s.del(kindInstances, id) }

// Instances implements Store.
func (s *Etcd) Instances() ([]Instance, error) { return listOf[Instance](s, kindInstances) }

// PutMigration implements Store.
func (s *Etcd) PutMigration(id string, record json.RawMessage) error {
	return s.write(clientv3.OpPut(s.prefix+kindMigrations+"/"+id, string(record)))
}

// DeleteMigration implements Store.
func (s *Etcd) DeleteMigration(id string) error { return s.del(kindMigrations, id) }

// Migrations implements Store.
func (s *Etcd) Migrations() (map[string]json.RawMessage, error) {
	vals, err := s.list(kindMigrations)
	if err != nil {
		return nil, err
	}
	out := make(map[string]json.RawMessage, len(vals))
	for id, v := range vals {
		out[id] = v
	}
	return out, nil
}

// PutLaunched implements Store.
func (s *Etcd) PutLaunched(l Launched) error { return s.put(kindLaunched, l.ID, l) }

// DeleteLaunched implements Store.
func (s *Etcd) DeleteLaunched(id string) error { return s.del(kindLaunched, id) }

// LaunchedEngines implements Store.
func (s *Etcd) LaunchedEngines() ([]Launched, error) { return listOf[Launched](s, kindLaunched) }

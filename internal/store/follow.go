package store

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// What the Hosts of a shared store tell each other besides the records:
// every Host serves clients and relays their streams, the leader decides
// (roles, migrations). A Host that follows learns the leader's decisions
// about instances by watching their records, and takes part in the
// leader's migrations through a board: the leader asks which of the
// requests it may move the others relay (a census), and publishes each
// committed migration's cut; every Host that relays some of its streams
// switches them and answers which.

// Switch is a committed migration's cut, as the Host that runs it
// publishes it for the Hosts that relay its streams.
type Switch struct {
	Migration string `json:"migration_id"`
	// Instance and EngineURL name the target, where the streams go on.
	Instance  string           `json:"instance"`
	EngineURL string           `json:"engine_url"`
	Streams   []SwitchedStream `json:"streams"`
}

// SwitchedStream is one moved request's place at the cut.
type SwitchedStream struct {
	ID string `json:"request_id"`
	// From is the output tokens the source made: the target streams from
	// this index.
	From int `json:"from"`
	// Text is the visible text's length (code points) after them, -1 when
	// unknown; Cut: the target sends the text a client lacks from where
	// it is (the relay stops reading the source at once).
	Text int  `json:"text"`
	Cut  bool `json:"cut,omitempty"`
}

// SwitchAck is a Host's answer to a Switch: the streams it relays that
// switched, and those that could not (with why).
type SwitchAck struct {
	Host     string            `json:"host"`
	Switched []string          `json:"switched,omitempty"`
	Failed   map[string]string `json:"failed,omitempty"`
}

// WatchInstances calls apply with every instance record now in the store
// and then with each change, until ctx ends (rec nil: id was deleted). A
// watch that etcd cancels (a compaction, a lost connection) starts over
// from a fresh read.
func (s *Etcd) WatchInstances(ctx context.Context, apply func(id string, rec *Instance)) {
	dir := s.prefix + kindInstances + "/"
	for ctx.Err() == nil {
		gctx, cancel := context.WithTimeout(ctx, s.timeout)
		resp, err := s.cli.Get(gctx, dir, clientv3.WithPrefix())
		cancel()
		if err != nil {
			s.log.Warn("reading the instances' records failed; retrying", zap.Error(err))
			sleepCtx(ctx, time.Second)
			continue
		}
		for _, kv := range resp.Kvs {
			applyInstance(apply, strings.TrimPrefix(string(kv.Key), dir), kv.Value, false)
		}
		wctx, wcancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range s.cli.Watch(wctx, dir, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1)) {
			if wr.Err() != nil {
				s.log.Warn("the watch of the instances' records ended; reading them again", zap.Error(wr.Err()))
				break
			}
			for _, ev := range wr.Events {
				applyInstance(apply, strings.TrimPrefix(string(ev.Kv.Key), dir), ev.Kv.Value, ev.Type == clientv3.EventTypeDelete)
			}
		}
		wcancel()
	}
}

func applyInstance(apply func(string, *Instance), id string, v []byte, deleted bool) {
	if deleted {
		apply(id, nil)
		return
	}
	var rec Instance
	if json.Unmarshal(v, &rec) == nil {
		apply(id, &rec)
	}
}

// The board: a Host that runs a migration posts a question (a census
// of the requests it may move, then its switch) under its lease; every
// other Host answers each under its own.
const (
	BoardCensus = "census"   // Census; answered with a CensusAnswer
	BoardSwitch = "switches" // Switch; answered with a SwitchAck
)

// Census asks the other Hosts which of a migration's candidate requests
// they relay (a migration moves only relayed streams: a client talking
// to the engine directly could not follow it).
type Census struct {
	Migration  string   `json:"migration_id"`
	RequestIDs []string `json:"request_ids"`
}

// CensusAnswer is one Host's answer to a Census: the streams it relays
// of those requests.
type CensusAnswer struct {
	Host    string                   `json:"host"`
	Streams map[string]RelayedStream `json:"streams,omitempty"`
}

// RelayedStream is what a migration's filter reads of a stream another
// Host relays.
type RelayedStream struct {
	Model   string    `json:"model"`
	Tag     string    `json:"tag,omitempty"`
	Started time.Time `json:"started"`
	// Instance is the engine the stream reads from now.
	Instance string `json:"instance,omitempty"`
}

// Post puts a question on the board under this Host's lease (it goes
// when this Host does), while this Host leads.
func (s *Etcd) Post(board, id string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return s.write(clientv3.OpPut(s.prefix+board+"/"+id, string(b), clientv3.WithLease(s.lease())))
}

// lease is this Host's lease now.
func (s *Etcd) lease() clientv3.LeaseID {
	sess, _ := s.session()
	return sess.Lease()
}

// Unpost takes a question and its answers off the board.
func (s *Etcd) Unpost(board, id string) {
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	_, _ = s.cli.Txn(ctx).Then(
		clientv3.OpDelete(s.prefix+board+"/"+id),
		clientv3.OpDelete(s.prefix+board+"-answers/"+id+"/", clientv3.WithPrefix()),
	).Commit()
}

// WatchBoard calls fn with each question posted on board from now on,
// until ctx ends.
func (s *Etcd) WatchBoard(ctx context.Context, board string, fn func(id string, v []byte)) {
	dir := s.prefix + board + "/"
	for ctx.Err() == nil {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range s.cli.Watch(wctx, dir, clientv3.WithPrefix(), clientv3.WithFilterDelete()) {
			if wr.Err() != nil {
				s.log.Warn("the watch of the board ended; watching it again", zap.String("board", board), zap.Error(wr.Err()))
				break
			}
			for _, ev := range wr.Events {
				fn(strings.TrimPrefix(string(ev.Kv.Key), dir), ev.Kv.Value)
			}
		}
		cancel()
		sleepCtx(ctx, 100*time.Millisecond)
	}
}

// Answer answers question id of board for this Host, under its lease.
func (s *Etcd) Answer(board, id string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	if _, err := s.cli.Put(ctx, s.prefix+board+"-answers/"+id+"/"+s.me.ID, string(b), clientv3.WithLease(s.lease())); err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	return nil
}

// Answers collects the answers to question id of board until every Host
// of hosts answered or ctx ends, and returns those that came, by Host.
func (s *Etcd) Answers(ctx context.Context, board, id string, hosts []string) map[string][]byte {
	dir := s.prefix + board + "-answers/" + id + "/"
	got := map[string][]byte{}
	all := func() bool {
		for _, h := range hosts {
			if _, ok := got[h]; !ok {
				return false
			}
		}
		return true
	}
	resp, err := s.cli.Get(ctx, dir, clientv3.WithPrefix())
	if err != nil {
		return got
	}
	for _, kv := range resp.Kvs {
		got[strings.TrimPrefix(string(kv.Key), dir)] = kv.Value
	}
	if all() {
		return got
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for wr := range s.cli.Watch(wctx, dir, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1), clientv3.WithFilterDelete()) {
		for _, ev := range wr.Events {
			got[strings.TrimPrefix(string(ev.Kv.Key), dir)] = ev.Kv.Value
		}
		if all() || wr.Err() != nil {
			break
		}
	}
	return got
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

package migrate_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
)

// With --migration-pre-attach the moving streams are opened on the target
// before the pause: a migration that rolls back after the install — even
// one whose commit landed on the target, which then produced tokens into
// those connections — drops them and every stream goes on from the source
// exactly; one that commits switches every moved stream over them.
func TestPreAttachedStreams(t *testing.T) {
	r := newRig(t, rigOptions{tune: func(hc *host.Config) { hc.Migration.PreAttach = true }})
	for _, f := range []*fault{
		{side: "dst", method: "Hook", hook: hooks.HookResume, code: codes.Unavailable},
		{side: "dst", method: "Hook", hook: hooks.HookResume, code: codes.Unavailable, after: true},
	} {
		st, err := r.migrate(hostapi.MigrateRequest{}, f)
		if err != nil {
			t.Fatal(err)
		}
		r.rolledBack(st, "commit on the target")
		if st.PreAttached != 0 {
			t.Fatalf("a rolled-back migration switched %d streams", st.PreAttached)
		}
		r.faults.mu.Lock()
		r.faults.list = nil
		r.faults.mu.Unlock()
	}
	st, err := r.migrate(hostapi.MigrateRequest{Type: hostapi.PreserveSource})
	if err != nil || st.State != hostapi.StateSucceeded {
		t.Fatalf("%+v %v", st, err)
	}
	if st.Migrated == 0 || st.PreAttached != st.Migrated {
		t.Fatalf("%d of %d moved streams switched over their pre-attached connection", st.PreAttached, st.Migrated)
	}
}

// A stream moved twice, each time over a pre-attach: the second
// pre-attach must not end the first, which is its upstream by then (a
// rolling restart's drains met that: every stream broke).
func TestStreamsMovedTwiceOverPreAttaches(t *testing.T) {
	r := newRig(t, rigOptions{streams: 12, tokens: 480, tune: func(hc *host.Config) { hc.Migration.PreAttach = true }})
	// Both engines hold the streams' last tokens until both hops are done.
	releaseA, releaseB := r.hold(r.st.AID), r.hold(r.st.BID)
	defer releaseA()
	defer releaseB()
	done := r.loadThroughHost()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, hop := range [][2]string{{r.st.AID, r.st.BID}, {r.st.BID, r.st.AID}} {
		st, err := r.st.Client().MigrateAndWait(ctx, hostapi.MigrateRequest{Src: hop[0], Dst: hop[1], Type: hostapi.PreserveSource}, 10*time.Millisecond)
		if err != nil || st.State != hostapi.StateSucceeded || st.Migrated == 0 || st.PreAttached != st.Migrated {
			t.Fatalf("%s → %s: %+v %v", hop[0], hop[1], st, err)
		}
	}
	releaseA()
	releaseB()
	r.exact(<-done)
}

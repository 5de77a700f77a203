package failover_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/vllm-hi/vllm-hi/internal/host"
)

// Warm copies are checked against their source's KV after each round.
// With the first bytes of every warm round corrupted on the way (a data
// plane that reports success with wrong bytes), the copy they land in
// differs when checked and is dropped; when A dies, the copies that were
// checked equal are installed, the others recomputed, and every stream
// equals its run without the crash (an installed copy with a wrong byte
// diverges: the sim derives each token from KV it reads back). Without
// the fault the same run drops none.
func TestAWarmCopyThatDiffersFromItsSourceIsNeverInstalled(t *testing.T) {
	for _, c := range []struct {
		name  string
		fault string
	}{{"corrupted on the way", "silent_corrupt"}, {"intact", ""}} {
		t.Run(c.name, func(t *testing.T) {
			differed, warm := warmCrash(t, c.fault)
			switch {
			case c.fault != "" && differed == 0:
				t.Fatalf("corrupted copies: none dropped by the check (%d streams installed from copies)", warm)
			case c.fault == "" && (differed != 0 || warm == 0):
				t.Fatalf("intact copies: %d dropped by the check, %d streams installed from copies; want none dropped, some installed", differed, warm)
			}
			t.Logf("%d copies dropped by the check, %d streams installed from copies", differed, warm)
		})
	}
}

// warmCrash runs 8 streams over active sims A and B with warm standbys
// (their rounds sent with fault), kills A once its streams have copies
// that had a round and checks every stream against its run without the
// crash. It returns the copies the check dropped and the streams
// recovered from copies.
func warmCrash(t *testing.T, fault string) (differed, warm int) {
	t.Helper()
	st := simsUnderAHost(t, 1024, 0, zaptest.NewLogger(t, zaptest.Level(zap.InfoLevel)), func(hc *host.Config) {
		hc.Failover.SnapshotInterval = 200 * time.Millisecond
		hc.Failover.WarmTokens = 1
		hc.Failover.WarmInterval = 100 * time.Millisecond
		hc.Failover.InjectWarmFault = fault
	})
	reqs := seededLoad(8, "warm check", func(i int) int { return 20 + 3*i }, func(int) int { return 600 }, func(int) float64 { return 0.5 })
	fo := st.Host.Failover()
	crashUnderLoad(t, st, reqs, func() (bool, string) {
		a, _ := st.A.Stats(context.Background())
		// Rounds ran for a while: copies made (and, corrupted, dropped).
		ok := a.NumRunning >= 2 && ((fault == "" && fo.WarmCopies() >= a.NumRunning) || (fault != "" && fo.WarmDiffered() >= 4))
		return ok, fmt.Sprintf("A runs %d, %d copies, %d dropped", a.NumRunning, fo.WarmCopies(), fo.WarmDiffered())
	}, 250*time.Millisecond) // a few more rounds
	return fo.WarmDiffered(), fo.WarmRecovered()
}

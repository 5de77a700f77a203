// Package periodic runs the Host's background loops (the heartbeat
// sweep, failover's snapshots, the balancer): one ticker, stopped with
// the loop, and no tick after ctx ends.
package periodic

import (
	"context"
	"time"
)

// Do calls fn every interval until ctx ends. A call that outlasts the
// interval delays the next one instead of piling calls up (the ticker
// drops the ticks missed meanwhile).
func Do(ctx context.Context, interval time.Duration, fn func()) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if ctx.Err() != nil { // both ready: select picks at random
				return
			}
			fn()
		}
	}
}

package bench

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/etcdtest"
	"github.com/vllm-hi/vllm-hi/internal/sim"
)

// BenchmarkMigrationByStore runs the same migration with the Host's state
// in the embedded store (bolt) and in etcd, side by side (issue 31's
// goal: the shared store adds at most 2 ms to the downtime). Each run
// migrates 64 streams from A to B, every stream checked against
// its unmigrated run; it reports the median downtime (A paused → B
// resumed), client downtime and switch step of its migrations.
//
//	go test -run '^$' -bench BenchmarkMigrationByStore -benchtime 5x ./internal/bench
func BenchmarkMigrationByStore(b *testing.B) {
	ep := etcdtest.Start(b)
	for _, store := range []string{"bolt", "etcd", "etcd-two-hosts"} {
		b.Run(store, func(b *testing.B) {
			var down, client, sw, own, other []float64
			for i := 0; i < b.N; i++ {
				sc := scenario{Streams: 64, MaxTokens: 200, PromptWords: 40, Delay: 1500 * time.Millisecond, Type: hostapi.PreserveSource,
					TN: 2, FinalGranularity: "slot", Greedy: true, Log: zap.NewNop(), HostDataDir: b.TempDir()}
				sc.Sim = sim.DefaultConfig()
				sc.Sim.NumBlocks, sc.Sim.ShmDir = 4096, b.TempDir()
				if store != "bolt" {
					sc.HostStore = "etcd://" + ep
					// A prefix of its own: no run waits for an earlier one's leader.
					sc.HostStorePrefix = fmt.Sprintf("/bench-%s-%d/", store, i)
				}
				if store == "etcd-two-hosts" {
					sc.Hosts = 2 // every other stream through a Host that does not run the migration
				}
				res, err := sc.run(context.Background())
				if err != nil {
					b.Fatal(err)
				}
				st := res.Status
				if st.State != hostapi.StateSucceeded || len(res.Mismatches) > 0 {
					b.Fatalf("%s: %s %s, %d streams differ", store, st.State, st.Error, len(res.Mismatches))
				}
				down, client = append(down, st.DowntimeS*1e3), append(client, st.ClientDowntimeS*1e3)
				if sc.Hosts == 2 {
					o, x := gapsAcrossThePause(res, 2)
					own, other = append(own, o), append(other, x)
				}
				for _, s := range st.StepHistory {
					if s.Step == "switch" {
						sw = append(sw, s.DurationS*1e3)
					}
				}
			}
			b.ReportMetric(median(down), "downtime-ms")
			b.ReportMetric(median(client), "client-downtime-ms")
			b.ReportMetric(median(sw), "switch-ms")
			b.Logf("%s: downtime %v ms, client downtime %v ms, switch %v ms", store, round(down), round(client), round(sw))
			if len(other) > 0 {
				b.ReportMetric(median(own), "leader-streams-pause-gap-ms")
				b.ReportMetric(median(other), "other-host-streams-pause-gap-ms")
				b.Logf("%s: clients' worst gap from the pause to the switch, through the Host that ran the migration %v ms, through the other %v ms", store, round(own), round(other))
			}
		})
	}
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Sorted(slices.Values(v))
	return s[len(s)/2]
}

func round(v []float64) []string {
	out := make([]string, len(v))
	for i, x := range v {
		out[i] = fmt.Sprintf("%.1f", x)
	}
	return out
}

// gapsAcrossThePause is, for the streams of the first Host and for those
// of the others (stream i through Host i mod hosts), the longest gap
// between two token events that ended between the source's pause and
// 200 ms after the switch: what the migration's pause and switch cost
// the clients of each, in ms.
func gapsAcrossThePause(res scenarioResult, hosts int) (first, others float64) {
	var from, to time.Time
	for _, s := range res.Status.StepHistory {
		switch s.Step {
		case "pause_source":
			from = s.StartedAt
		case "switch":
			to = s.EndedAt.Add(200 * time.Millisecond)
		}
	}
	for i, s := range res.Streams {
		for j := 1; j < len(s.Arrivals); j++ {
			if !s.Arrivals[j].After(from) || s.Arrivals[j].After(to) {
				continue
			}
			g := ms(s.Arrivals[j].Sub(s.Arrivals[j-1]))
			if i%hosts == 0 {
				first = max(first, g)
			} else {
				others = max(others, g)
			}
		}
	}
	return first, others
}

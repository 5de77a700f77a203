package sim

import (
	"strings"
	"testing"
	"time"
)

// Each mode puts its costs where the seed's table does: the engine serves
// through the prepare phase and answers 503 only through the commit.
func TestElasticModes(t *testing.T) {
	for _, c := range []struct {
		mode                string
		minServing, minDown time.Duration
	}{
		{ElasticBlocking, 0, 350 * time.Millisecond},
		{ElasticAsync, 150 * time.Millisecond, 200 * time.Millisecond},
		{ElasticAsyncGraphReuse, 350 * time.Millisecond, 0},
	} {
		t.Run(c.mode, func(t *testing.T) {
			cfg := testConfig(t)
			cfg.ElasticEP, cfg.ElasticMode = true, c.mode
			cfg.ElasticPrepareTime, cfg.ElasticGraphTime, cfg.ElasticActivateTime = 150*time.Millisecond, 200*time.Millisecond, 20*time.Millisecond
			e := startEngine(t, cfg)
			_, ts := startServer(t, e)
			t0 := time.Now()
			done := make(chan []byte)
			go func() {
				_, b := post(t, ts.URL+"/scale_elastic_ep", `{"new_data_parallel_size":2}`)
				done <- b
			}()
			var firstDown, lastDown time.Time
			for {
				select {
				case b := <-done:
					if !strings.Contains(string(b), "Scaled to 2 data parallel engines") || e.DataParallelSize() != 2 {
						t.Fatalf("scale: %s, size %d", b, e.DataParallelSize())
					}
					serving, down := firstDown.Sub(t0), lastDown.Sub(firstDown)
					if firstDown.IsZero() {
						serving, down = time.Since(t0), 0
					}
					t.Logf("%s: served %v, then 503 for %v", c.mode, serving, down)
					if serving < c.minServing-30*time.Millisecond || down < c.minDown-30*time.Millisecond || (c.minDown == 0 && down > 150*time.Millisecond) {
						t.Fatalf("%s: served %v (want ≥ %v), then 503 for %v (want ≥ %v)", c.mode, serving, c.minServing, down, c.minDown)
					}
					return
				default:
				}
				resp, _ := get(t, ts.URL+"/health")
				if resp.StatusCode == 503 {
					if firstDown.IsZero() {
						firstDown = time.Now()
					}
					lastDown = time.Now()
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
}

// A scale to the current size changes nothing; without --enable-elastic-ep
// it is refused.
func TestElasticRefusals(t *testing.T) {
	e := startEngine(t, testConfig(t))
	_, ts := startServer(t, e)
	if resp, b := post(t, ts.URL+"/scale_elastic_ep", `{"new_data_parallel_size":2}`); resp.StatusCode != 400 || !strings.Contains(string(b), "--enable-elastic-ep") {
		t.Fatalf("without elastic EP: %d %s", resp.StatusCode, b)
	}
	c := testConfig(t)
	c.ElasticEP, c.DataParallelSize = true, 2
	e2 := startEngine(t, c)
	_, ts2 := startServer(t, e2)
	t0 := time.Now()
	if resp, b := post(t, ts2.URL+"/scale_elastic_ep", `{"new_data_parallel_size":2}`); resp.StatusCode != 200 || time.Since(t0) > 30*time.Millisecond {
		t.Fatalf("to the current size: %d %s after %v", resp.StatusCode, b, time.Since(t0))
	}
}

// Every data-parallel rank brings its seats: twice the ranks, twice the
// requests in one step.
func TestDataParallelSeats(t *testing.T) {
	c := testConfig(t)
	c.MaxNumSeqs, c.MaxNumBatchedTokens, c.DataParallelSize = 2, 256, 2
	e := startEngine(t, c)
	_, ts := startServer(t, e)
	done := make(chan struct{})
	for range 4 {
		go func() {
			post(t, ts.URL+"/v1/completions", `{"model":"test-model","prompt":"seat","max_tokens":40,"ignore_eos":true}`)
			done <- struct{}{}
		}()
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		st, _ := e.Stats(t.Context())
		if st.NumRunning == 4 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("running %d of 4 with 2 ranks of 2 seats", st.NumRunning)
		}
		time.Sleep(2 * time.Millisecond)
	}
	for range 4 {
		<-done
	}
}

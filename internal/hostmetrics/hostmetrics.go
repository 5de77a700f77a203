// Package hostmetrics reads a Host's Prometheus metrics, for the
// benchmarks and the tests that report or check them.
package hostmetrics

import (
	"bufio"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// Value is the sample of name (with its labels as the exposition writes
// them, e.g. `vhi_failovers_total{outcome="warm"}`) at hostURL/metrics; 0
// when the Host does not export it (a counter not yet counted).
func Value(hostURL, name string) (float64, error) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(hostURL + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("%s/metrics: HTTP %d", hostURL, resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			var v float64
			if _, err := fmt.Sscan(strings.TrimSpace(rest), &v); err != nil {
				return 0, fmt.Errorf("%s: %w", name, err)
			}
			return v, nil
		}
	}
	return 0, sc.Err()
}

// ByLabel is every sample of metric name by the value of its one label
// (e.g. vhi_failovers_total by outcome).
func ByLabel(hostURL, name, label string) (map[string]float64, error) {
	c := http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get(hostURL + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	prefix := name + "{" + label + `="`
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), prefix)
		if !ok {
			continue
		}
		key, val, ok := strings.Cut(rest, `"} `)
		if !ok {
			continue
		}
		var v float64
		if _, err := fmt.Sscan(val, &v); err == nil {
			out[key] = v
		}
	}
	return out, sc.Err()
}

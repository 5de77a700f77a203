package hostmetrics

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

func TestValueAndByLabel(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("# HELP vhi_failover_warm_copies x\nvhi_failover_warm_copies 12\n" +
			"vhi_failovers_total{outcome=\"warm\"} 6\nvhi_failovers_total{outcome=\"recovered\"} 2\nvhi_failover_warm_bytes_total 5.9e+07\n"))
	}))
	defer srv.Close()
	for name, want := range map[string]float64{"vhi_failover_warm_copies": 12, `vhi_failovers_total{outcome="warm"}`: 6,
		"vhi_failover_warm_bytes_total": 5.9e7, "vhi_absent": 0} {
		if got, err := Value(srv.URL, name); err != nil || got != want {
			t.Errorf("%s: %v, %v; want %v", name, got, err, want)
		}
	}
	by, err := ByLabel(srv.URL, "vhi_failovers_total", "outcome")
	if err != nil || len(by) != 2 || by["warm"] != 6 || by["recovered"] != 2 {
		t.Fatalf("by outcome: %v, %v", by, err)
	}
	if _, err := Value("http://127.0.0.1:1", "x"); err == nil {
		t.Fatal("a Host that cannot be reached read as a value")
	}
}

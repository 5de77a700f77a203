package durations

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
)

// A field in seconds reads a number or a duration as the flags spell it,
// from YAML and JSON alike, and refuses anything else naming the line.
func TestSecondsReadNumbersAndDurations(t *testing.T) {
	var v struct {
		A, B, C, D Seconds
	}
	if err := yaml.Unmarshal([]byte("a: 90\nb: 0.5\nc: 10m\nd: 1h30m5s\n"), &v); err != nil {
		t.Fatal(err)
	}
	want := []time.Duration{90 * time.Second, 500 * time.Millisecond, 10 * time.Minute, time.Hour + 30*time.Minute + 5*time.Second}
	for i, got := range []Seconds{v.A, v.B, v.C, v.D} {
		if got.Duration() != want[i] {
			t.Errorf("field %d: %v, want %v", i, got.Duration(), want[i])
		}
	}
	var j struct{ X, Y Seconds }
	if err := json.Unmarshal([]byte(`{"X": 2.5, "Y": "3s"}`), &j); err != nil || j.X != 2.5 || j.Y != 3 {
		t.Fatalf("JSON: %+v, %v", j, err)
	}
	for _, bad := range []string{"a: ten\n", "a: [1]\n", "a: 5 minutes\n"} {
		err := yaml.Unmarshal([]byte(bad), &v)
		if err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Errorf("%q: %v, want an error naming line 1", bad, err)
		}
	}
	if err := json.Unmarshal([]byte(`{"X": true}`), &j); err == nil {
		t.Error("a boolean read as seconds")
	}
}

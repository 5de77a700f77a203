package store

import (
	"testing"
	"time"
)

// The launched engines' records survive a reopen (a Host restart) and go
// when deleted.
func TestLaunchedEnginesSurviveAReopen(t *testing.T) {
	dir := t.TempDir()
	s, err := OpenBolt(dir)
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 12, 2, 13, 0, 0, 0, time.UTC)
	for _, l := range []Launched{{ID: "r-1", Model: "m", PID: 41, Start: 9001, LogFile: "/x/r-1.log", At: at}, {ID: "r-2", Model: "m", PID: 42, Start: 9002}} {
		if err := s.PutLaunched(l); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.DeleteLaunched("r-2"); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if s, err = OpenBolt(dir); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.LaunchedEngines()
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].ID != "r-1" || got[0].PID != 41 || got[0].Start != 9001 || got[0].LogFile != "/x/r-1.log" || !got[0].At.Equal(at) {
		t.Fatalf("after a reopen: %+v", got)
	}
}

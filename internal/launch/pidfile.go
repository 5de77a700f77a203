package launch

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// Format names the PID file's layout; a file without it (a legacy one, or
// another program's) is refused.
const Format = "vhi-launch/1"

// PIDFile is what vhi launch writes once the pool is ready and vhi stop
// reads: every process it started, with what identifies it.
type PIDFile struct {
	Format      string    `json:"format"`
	CreatedAt   time.Time `json:"created_at"`
	LauncherPID int       `json:"launcher_pid"`
	Backends    []Backend `json:"backends"`
}

// Backend is one launched engine.
type Backend struct {
	Model      string   `json:"model"`
	PID        int      `json:"pid"`
	PGID       int      `json:"pgid"`
	StartTime  uint64   `json:"start_time_ticks"`
	Argv       []string `json:"argv"`
	BackendURL string   `json:"backend_url"`
	Log        string   `json:"log"`
}

// write puts f at path atomically: a reader sees the whole file or none.
func (f PIDFile) write(path string) error {
	b, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".pid-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // gone after the rename
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// ReadPIDFile reads and checks a PID file.
func ReadPIDFile(path string) (PIDFile, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return PIDFile{}, err
	}
	var f PIDFile
	if err := json.Unmarshal(b, &f); err != nil {
		return PIDFile{}, fmt.Errorf("%s is not a vhi launch PID file (refusing it): %w", path, err)
	}
	if f.Format != Format {
		return PIDFile{}, fmt.Errorf("%s is not a %s PID file (format %q): refusing it rather than signal processes it may not own", path, Format, f.Format)
	}
	for i, b := range f.Backends {
		if b.PID <= 1 || b.PGID <= 1 || b.StartTime == 0 {
			return PIDFile{}, fmt.Errorf("%s: backend %d (%s) has no valid pid, pgid and start time: refusing the file", path, i, b.Model)
		}
	}
	return f, nil
}

package launch

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// procInfo is what /proc/PID/stat says of a process that identifies it:
// its process group and its start time (clock ticks after boot), which a
// reused PID does not share.
type procInfo struct {
	PGID      int
	StartTime uint64
}

// errNoProcess: no process has the PID.
var errNoProcess = errors.New("no such process")

// readProc reads /proc/PID/stat.
func readProc(pid int) (procInfo, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		return procInfo{}, errNoProcess
	}
	if err != nil {
		return procInfo{}, err
	}
	// The command name (field 2) is in parentheses and may hold spaces
	// and parentheses itself: the fields after it start at the last ')'.
	s := string(b)
	end := strings.LastIndexByte(s, ')')
	if end < 0 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: no command field", pid)
	}
	f := strings.Fields(s[end+1:])
	// f[0] is field 3 (state): pgrp is field 5, starttime field 22.
	if len(f) < 20 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f)+2)
	}
	if f[0] == "Z" {
		return procInfo{}, errNoProcess // a zombie has exited; only its parent's wait is missing
	}
	pgid, err := strconv.Atoi(f[2])
	if err != nil {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: pgrp %q", pid, f[2])
	}
	start, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: starttime %q", pid, f[19])
	}
	return procInfo{PGID: pgid, StartTime: start}, nil
}

// groupAlive says whether any process is left in process group pgid.
func groupAlive(pgid int) bool {
	err := syscall.Kill(-pgid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// Package shm maps an engine's shared-memory KV regions into the agent.
package shm

import (
	"fmt"
	"os"
	"syscall"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Regions are an engine's KV regions mapped into this process, in the
// order of its layout.
type Regions struct {
	Data  [][]byte
	paths []string
}

// Map maps every region of a layout (shm kind only). Writable mappings are
// for a migration target.
func Map(l hooks.Layout, writable bool) (*Regions, error) {
	r := &Regions{}
	for i, reg := range l.Regions {
		if reg.Memory.Kind != hooks.MemoryShm {
			r.Close()
			return nil, fmt.Errorf("region %d is %q memory; tcp_shm needs shm", i, reg.Memory.Kind)
		}
		b, err := mapFile(reg.Memory.Path, reg.Size, writable)
		if err != nil {
			r.Close()
			return nil, err
		}
		r.Data = append(r.Data, b)
		r.paths = append(r.paths, reg.Memory.Path)
	}
	return r, nil
}

func mapFile(path string, size int64, writable bool) ([]byte, error) {
	flag, prot := os.O_RDONLY, syscall.PROT_READ
	if writable {
		flag, prot = os.O_RDWR, syscall.PROT_READ|syscall.PROT_WRITE
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, fmt.Errorf("open KV region: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() < size {
		return nil, fmt.Errorf("KV region %s is %d bytes, layout says %d", path, st.Size(), size)
	}
	b, err := syscall.Mmap(int(f.Fd()), 0, int(size), prot, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("map KV region %s: %w", path, err)
	}
	return b, nil
}

// Same reports whether r maps exactly the regions of l.
func (r *Regions) Same(l hooks.Layout) bool {
	if r == nil || len(r.paths) != len(l.Regions) {
		return false
	}
	for i, reg := range l.Regions {
		if r.paths[i] != reg.Memory.Path || int64(len(r.Data[i])) != reg.Size {
			return false
		}
	}
	return true
}

// Close unmaps everything.
func (r *Regions) Close() {
	if r == nil {
		return
	}
	for _, b := range r.Data {
		_ = syscall.Munmap(b)
	}
	r.Data, r.paths = nil, nil
}

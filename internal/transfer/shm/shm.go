// Package shm maps an engine's shared-memory KV regions into the agent.
package shm

import (
	"fmt"
	"os"
	"syscall"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Regions are an engine's KV regions mapped into this process, in the
// order of its layout. Each mapping remembers the file it maps by device
// and inode, not by path: an engine that sleeps and wakes re-creates its
// KV under the same path, and a mapping of the old, unlinked file would
// read and write memory the engine no longer uses.
type Regions struct {
	Data       [][]byte
	ids        []fileID
	generation uint64
}

type fileID struct {
	path     string
	dev, ino uint64
	size     int64
}

// Map maps every region of a layout (shm kind only). Writable mappings are
// for a migration target.
func Map(l hooks.Layout, writable bool) (*Regions, error) {
	r := &Regions{generation: l.KVGeneration}
	for i, reg := range l.Regions {
		if reg.Memory.Kind != hooks.MemoryShm {
			r.Close()
			return nil, fmt.Errorf("region %d is %q memory; tcp_shm needs shm", i, reg.Memory.Kind)
		}
		b, id, err := mapFile(reg.Memory.Path, reg.Size, writable)
		if err != nil {
			r.Close()
			return nil, err
		}
		r.Data = append(r.Data, b)
		r.ids = append(r.ids, id)
	}
	return r, nil
}

func mapFile(path string, size int64, writable bool) ([]byte, fileID, error) {
	flag, prot := os.O_RDONLY, syscall.PROT_READ
	if writable {
		flag, prot = os.O_RDWR, syscall.PROT_READ|syscall.PROT_WRITE
	}
	f, err := os.OpenFile(path, flag, 0)
	if err != nil {
		return nil, fileID{}, fmt.Errorf("open KV region: %w", err)
	}
	defer f.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fileID{}, fmt.Errorf("stat KV region %s: %w", path, err)
	}
	if st.Size < size {
		return nil, fileID{}, fmt.Errorf("KV region %s is %d bytes, layout says %d", path, st.Size, size)
	}
	b, err := syscall.Mmap(int(f.Fd()), 0, int(size), prot, syscall.MAP_SHARED)
	if err != nil {
		return nil, fileID{}, fmt.Errorf("map KV region %s: %w", path, err)
	}
	return b, fileID{path: path, dev: uint64(st.Dev), ino: st.Ino, size: size}, nil
}

// Same reports whether r maps exactly the memory l describes now: the
// same engine generation, and for each region the same file (device and
// inode behind the path, which for /proc/<pid>/fd/<n> paths is the file
// the engine holds open) and size.
func (r *Regions) Same(l hooks.Layout) bool {
	if r == nil || len(r.ids) != len(l.Regions) || r.generation != l.KVGeneration {
		return false
	}
	for i, reg := range l.Regions {
		id := r.ids[i]
		if id.path != reg.Memory.Path || id.size != reg.Size {
			return false
		}
		var st syscall.Stat_t
		if err := syscall.Stat(reg.Memory.Path, &st); err != nil || uint64(st.Dev) != id.dev || st.Ino != id.ino {
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
	r.Data, r.ids = nil, nil
}

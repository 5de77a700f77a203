package sim

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/cespare/xxhash/v2"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// kvMemory holds the engine's KV bytes: one shared-memory file per rank ×
// stage, mapped into this process. An agent maps the same files to read or
// write blocks without going through the engine.
type kvMemory struct {
	geo     kvlayout.Geometry
	regions []kvRegion
	gpu     *gpuKV // nil: the regions are shared-memory files
}

type kvRegion struct {
	layout kvlayout.RegionLayout
	path   string   // what agents open: /proc/<pid>/fd/<n> of the unlinked file
	file   *os.File // held open: the memory lives as long as this process
	data   []byte
	dptr   cuda.DevicePtr // GPU: the region's allocation
	gpuAt  int            // GPU: which of gpuKV.devs holds it
	// Strides, precomputed: the decode step touches every layer and head of
	// every token, so this is the sim's hottest arithmetic. slotBytes is
	// one head's vector of one slot (head_dim × dtype).
	layerStride, kvStride, blockStride, headStride, slotStride, slotBytes int
}

// newKVRegion is a region of layout l with its strides.
func newKVRegion(l kvlayout.RegionLayout) kvRegion {
	return kvRegion{
		layout:      l,
		layerStride: int(l.LayerStride()), kvStride: int(l.KVStride()), blockStride: int(l.BlockStride()),
		headStride: int(l.HeadStride()), slotStride: int(l.SlotStride()), slotBytes: l.Geometry.HeadSlotBytes(),
	}
}

// regionLayouts are the layouts of par's shards of geo, slot-major (NHD)
// or head-major (HND).
func regionLayouts(geo kvlayout.Geometry, par kvlayout.Parallel, slotMajor bool) []kvlayout.RegionLayout {
	var out []kvlayout.RegionLayout
	for _, s := range kvlayout.Shards(par) {
		l := kvlayout.NewRegionLayout(geo, s)
		l.SlotMajor = slotMajor
		out = append(out, l)
	}
	return out
}

// newKVMemory creates one file per shard under dir, named
// prefix-tp{rank}-pp{stage}.kv, allocates its pages and maps it. Each file
// is unlinked at once and kept open, and agents map it as
// /proc/<pid>/fd/<n>: the memory goes away with the process however it
// ends (SIGKILL skips every cleanup), and nothing is left in the tmpfs.
// The pages are allocated up front (fallocate) so that a tmpfs too small
// for the KV is a clear error here, not a SIGBUS at the first write into
// a page that cannot be backed.
func newKVMemory(geo kvlayout.Geometry, par kvlayout.Parallel, slotMajor bool, dir, prefix string) (*kvMemory, error) {
	m := &kvMemory{geo: geo}
	layouts := regionLayouts(geo, par, slotMajor)
	var total int64
	for _, l := range layouts {
		total += l.Size()
	}
	if err := checkRoom(dir, total); err != nil {
		return nil, err
	}
	for _, l := range layouts {
		path := filepath.Join(dir, fmt.Sprintf("%s-tp%d-pp%d.kv", prefix, l.Shard.TPRank, l.Shard.PPStage))
		f, data, err := mapFile(path, l.Size())
		if err != nil {
			m.close()
			return nil, err
		}
		r := newKVRegion(l)
		r.path, r.file, r.data = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), f.Fd()), f, data
		m.regions = append(m.regions, r)
	}
	return m, nil
}

// checkRoom refuses KV that does not fit the filesystem's free space.
func checkRoom(dir string, size int64) error {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return fmt.Errorf("KV directory %s: %w", dir, err)
	}
	if free := int64(st.Bavail) * st.Bsize; free < size {
		return fmt.Errorf("the KV needs %.2f GiB but %s has %.2f GiB free: lower --num-gpu-blocks or raise --kv-scale, or give the tmpfs more room",
			float64(size)/(1<<30), dir, float64(free)/(1<<30))
	}
	return nil
}

func mapFile(path string, size int64) (*os.File, []byte, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, nil, fmt.Errorf("create KV file: %w", err)
	}
	// Unlinked at once: the open file is the only name it keeps.
	_ = os.Remove(path)
	if err := syscall.Fallocate(int(f.Fd()), 0, 0, size); err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("allocate %.2f GiB of KV in %s: %w", float64(size)/(1<<30), filepath.Dir(path), err)
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		f.Close()
		return nil, nil, fmt.Errorf("map KV file %s: %w", path, err)
	}
	return f, data, nil
}

// close unmaps and removes every file (or frees the GPU memory); the KV is
// gone afterwards.
func (m *kvMemory) close() {
	if m.gpu != nil {
		m.gpu.close(m)
		m.regions = nil
		return
	}
	for _, r := range m.regions {
		if r.data != nil {
			_ = syscall.Munmap(r.data)
		}
		if r.file != nil {
			_ = r.file.Close()
		}
	}
	m.regions = nil
}

// tokenKey is the part of a token's KV content shared by all its layers and
// heads: the request's seed, the token id and its position.
func tokenKey(seed int64, token, pos int) uint64 {
	return mix64(uint64(seed)*0x9E3779B97F4A7C15 ^ uint64(token)<<32 ^ uint64(pos))
}

// kvWord is the deterministic content of the w-th 8-byte word of one
// head's K or V vector of the token with key k: a function of token id,
// position, layer, head, K/V and the request's seed.
func kvWord(k uint64, layer, kv, head, w int) uint64 {
	return mix64(k ^ uint64(layer)<<48 ^ uint64(kv)<<47 ^ uint64(head)<<32 ^ uint64(w))
}

// mix64 is the SplitMix64 finalizer.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	x ^= x >> 31
	return x
}

// writeToken writes the KV of one token (every layer, K and V, every head,
// in every shard) into slot of block.
func (m *kvMemory) writeToken(block, slot int, seed int64, token, pos int) {
	if m.gpu != nil {
		m.gpu.jobs = append(m.gpu.jobs, tokenJob{block: block, slot: slot, seed: seed, token: token, pos: pos})
		return
	}
	k := tokenKey(seed, token, pos)
	for i := range m.regions {
		r := &m.regions[i]
		l := &r.layout
		base := block*r.blockStride + slot*r.slotStride
		for layer := 0; layer < l.NumLayers; layer++ {
			for kv := 0; kv < 2; kv++ {
				off := layer*r.layerStride + kv*r.kvStride + base
				for h := 0; h < l.NumHeads; h++ {
					dst := r.data[off : off+r.slotBytes]
					off += r.headStride
					gl, gh := l.FirstLayer+layer, l.FirstHead+h
					fillSlot(dst, k, gl, kv, gh)
				}
			}
		}
	}
}

// fillSlot writes one head's K or V vector of the token with key k.
//
// Not instrumented, as foldBytes: dst is KV memory (a mapped file, or the GPU
// path's pinned staging), outside Go's heap.
//
//go:norace
func fillSlot(dst []byte, k uint64, layer, kv, head int) {
	w := 0
	for ; (w+1)*8 <= len(dst); w++ {
		binary.LittleEndian.PutUint64(dst[w*8:], kvWord(k, layer, kv, head, w))
	}
	if w*8 < len(dst) {
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], kvWord(k, layer, kv, head, w))
		copy(dst[w*8:], tail[:])
	}
}

// hashSlots feeds slots [0, n) of block into d in a canonical order —
// global layer, K/V, global head, slot — whatever the TP/PP sharding and
// the layout (head- or slot-major), so the same KV gives the same hash (and
// the same tokens) at any shape. A full block goes in as whole per-layer
// runs of each rank (xxhash streams them at memory speed; a slot-major run
// head by head, slot by slot); a partial one is folded word by word, head by
// head, into one value (cheaper than many tiny digest writes), so stale bytes
// past the written slots never reach the hash. Each rank's bytes of a layer's
// K or V are read at once: one read of the block's first n slots.
//
// With groups > 1 only the layers whose global index ≡ group (mod groups)
// are read: a 1/groups sample of the block.
func (m *kvMemory) hashSlots(d *xxhash.Digest, rd kvReader, block, n, group, groups int) {
	full := n == m.geo.BlockSize
	length := n * m.geo.HeadSlotBytes()
	_, plan := rd.(*planReader) // only recording what to gather
	tp := m.regions[0].layout.Shard.TPSize
	fold := uint64(n)
	for stage := 0; stage < len(m.regions)/tp; stage++ {
		ranks := m.regions[stage*tp : (stage+1)*tp]
		for layer := 0; layer < ranks[0].layout.NumLayers; layer++ {
			if (ranks[0].layout.FirstLayer+layer)%groups != group {
				continue
			}
			for kv := 0; kv < 2; kv++ {
				for i := range ranks {
					r := &ranks[i]
					off := layer*r.layerStride + kv*r.kvStride + block*r.blockStride
					switch {
					case r.layout.SlotMajor:
						b := rd.read(stage*tp+i, off, n*r.slotStride)
						if plan {
							continue
						}
						for h := 0; h < r.layout.NumHeads; h++ {
							for s := 0; s < n; s++ {
								at := s*r.slotStride + h*r.slotBytes
								if full {
									_, _ = d.Write(b[at : at+r.slotBytes])
								} else {
									fold = foldBytes(fold, b[at:at+r.slotBytes])
								}
							}
						}
					case full:
						b := rd.read(stage*tp+i, off, r.blockStride)
						if !plan {
							_, _ = d.Write(b)
						}
					default:
						for h := 0; h < r.layout.NumHeads; h++ {
							b := rd.read(stage*tp+i, off, length)
							if !plan {
								fold = foldBytes(fold, b)
							}
							off += r.headStride
						}
					}
				}
			}
		}
	}
	if !full {
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], fold)
		_, _ = d.Write(b[:])
	}
}

// flushWrites makes this step's token writes visible in KV memory (a no-op
// for files: they were written in place).
func (m *kvMemory) flushWrites() error {
	if m.gpu == nil {
		return nil
	}
	return m.gpu.flush(m)
}

// kvReader hands out the bytes of (region, offset, length) in KV memory.
type kvReader interface {
	read(region, off, n int) []byte
}

// hostReader reads the mapped files directly.
type hostReader struct{ m *kvMemory }

func (h hostReader) read(region, off, n int) []byte { return h.m.regions[region].data[off : off+n] }

// foldBytes mixes b into h, 8 bytes at a time (a trailing partial word is
// zero-padded). Any changed byte changes the result.
//
// Not instrumented: b is KV memory, mapped outside Go's heap, where the race
// detector cannot see anything; instrumenting each word only cost time
// (under -race the sim's steps took more than a core at 32 streams and
// starved the migration they were meant to test: docs/architecture.md).
//
//go:norace
func foldBytes(h uint64, b []byte) uint64 {
	for len(b) >= 8 {
		h = (h ^ binary.LittleEndian.Uint64(b)) * 0x9E3779B97F4A7C15
		h ^= h >> 29
		b = b[8:]
	}
	if len(b) > 0 {
		var t [8]byte
		copy(t[:], b)
		h = (h ^ binary.LittleEndian.Uint64(t[:])) * 0x9E3779B97F4A7C15
		h ^= h >> 29
	}
	return h
}

package sim

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/cespare/xxhash/v2"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// kvMemory holds the engine's KV bytes: one shared-memory file per rank ×
// stage, mapped into this process. An agent maps the same files to read or
// write blocks without going through the engine.
type kvMemory struct {
	geo     kvlayout.Geometry
	regions []kvRegion
}

type kvRegion struct {
	layout kvlayout.RegionLayout
	path   string
	data   []byte
}

// newKVMemory creates (truncating) one file per shard under dir, named
// prefix-tp{rank}-pp{stage}.kv, and maps each. The files are sparse: pages
// cost memory only once written.
func newKVMemory(geo kvlayout.Geometry, par kvlayout.Parallel, dir, prefix string) (*kvMemory, error) {
	m := &kvMemory{geo: geo}
	for _, s := range par.Shards() {
		l := kvlayout.NewRegionLayout(geo, s)
		path := filepath.Join(dir, fmt.Sprintf("%s-tp%d-pp%d.kv", prefix, s.TPRank, s.PPStage))
		data, err := mapFile(path, l.Size())
		if err != nil {
			m.close()
			return nil, err
		}
		m.regions = append(m.regions, kvRegion{layout: l, path: path, data: data})
	}
	return m, nil
}

func mapFile(path string, size int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("create KV file: %w", err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("size KV file %s to %d bytes: %w", path, size, err)
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, fmt.Errorf("map KV file %s: %w", path, err)
	}
	return data, nil
}

// close unmaps and removes every file; the KV is gone afterwards.
func (m *kvMemory) close() {
	for _, r := range m.regions {
		if r.data != nil {
			_ = syscall.Munmap(r.data)
		}
		_ = os.Remove(r.path)
	}
	m.regions = nil
}

// kvWord is the deterministic content of the w-th 8-byte word of one head's
// K or V vector for one token. It depends on everything the issue names:
// token id, position, layer, head, K/V and the request's seed.
func kvWord(seed int64, token, pos, layer, kv, head, w int) uint64 {
	x := uint64(seed)*0x9E3779B97F4A7C15 ^ uint64(token)<<40 ^ uint64(pos)<<8 ^ uint64(w)
	x = mix64(x ^ uint64(layer)<<52 ^ uint64(kv)<<51 ^ uint64(head)<<44)
	return mix64(x)
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
	hb := m.geo.HeadSlotBytes()
	var buf [8]byte
	for i := range m.regions {
		r := &m.regions[i]
		l := r.layout
		for layer := 0; layer < l.NumLayers; layer++ {
			for kv := 0; kv < 2; kv++ {
				for h := 0; h < l.NumHeads; h++ {
					off := l.Offset(layer, kv, block, h, slot)
					dst := r.data[off : off+int64(hb)]
					for w := 0; w*8 < hb; w++ {
						v := kvWord(seed, token, pos, l.FirstLayer+layer, kv, l.FirstHead+h, w)
						if (w+1)*8 <= hb {
							binary.LittleEndian.PutUint64(dst[w*8:], v)
						} else {
							binary.LittleEndian.PutUint64(buf[:], v)
							copy(dst[w*8:], buf[:])
						}
					}
				}
			}
		}
	}
}

// hashSlots feeds slots [0, n) of block, every shard, into d. A full block
// is read as whole per-layer runs; a partial one head by head, so stale
// bytes past the written slots never reach the hash.
func (m *kvMemory) hashSlots(d *xxhash.Digest, block, n int) {
	full := n == m.geo.BlockSize
	for i := range m.regions {
		r := &m.regions[i]
		l := r.layout
		if full {
			stride := l.BlockStride()
			for layer := 0; layer < l.NumLayers; layer++ {
				for kv := 0; kv < 2; kv++ {
					off := l.Offset(layer, kv, block, 0, 0)
					_, _ = d.Write(r.data[off : off+stride])
				}
			}
			continue
		}
		length := int64(n) * int64(m.geo.HeadSlotBytes())
		for layer := 0; layer < l.NumLayers; layer++ {
			for kv := 0; kv < 2; kv++ {
				for h := 0; h < l.NumHeads; h++ {
					off := l.Offset(layer, kv, block, h, 0)
					_, _ = d.Write(r.data[off : off+length])
				}
			}
		}
	}
}

// Package tcpshm is the tcp_shm data plane: the source agent reads the
// engine's shared memory and streams copy runs over several TCP
// connections; the target agent writes them straight into its engine's
// shared memory.
//
// Every connection is authenticated before a byte of KV is read: both
// ends prove with an HMAC over fresh nonces that they hold the
// migration's secret, which only the Host hands out (over the agents'
// authenticated gRPC). A session also expires, and the target writes only
// into the blocks reserved for that migration (kvlayout.BlockGuard).
// Every frame carries an xxhash64 of its bytes, checked on arrival; a
// round succeeds only when the target acknowledged every frame with a
// matching checksum. The checksum catches transport damage; it is not a
// MAC — the Host's end-to-end check of the moved blocks before the commit
// is what proves the target holds what the source held.
package tcpshm

import (
	"encoding/binary"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// maxFrame bounds one frame's payload; longer runs are split so several
// connections share the work.
const maxFrame = 4 << 20

const (
	magic        = "VHI-TCPSHM/3\n"
	frameHdrSize = 24 // runs u32, kind u32, payload length u64, xxhash64 u64
	runDescSize  = 20 // region u32, offset u64, length u64
	maxRuns      = 8192
)

// A frame carries up to maxRuns runs and maxFrame payload bytes: a header,
// one descriptor per run, then the runs' bytes back to back, checksummed
// together. Batching matters for the final round, whose token-slot runs
// are many and tiny (one per layer, K/V and head of each written slot
// range). A frame with zero runs ends the connection's share.
type frameHeader struct {
	runs   uint32 // descriptors in the frame
	kind   uint32 // frameRuns or frameSlots
	length uint64
	sum    uint64
}

// Frame kinds. A runs frame carries explicit (region, offset, length)
// descriptors. A slots frame carries (target block, first slot, slots)
// jobs whose bytes come in canonical order — layer, K/V, head — and the
// target expands them with its own layout: the final round's token slots
// are one tiny run per layer, K/V and head, so describing each would cost
// more than the bytes.
const (
	frameRuns  = 0
	frameSlots = 1
	jobSize    = 12 // block u32, first slot u32, slots u32
)

func (h frameHeader) put(b []byte) {
	binary.LittleEndian.PutUint32(b[0:], h.runs)
	binary.LittleEndian.PutUint32(b[4:], h.kind)
	binary.LittleEndian.PutUint64(b[8:], h.length)
	binary.LittleEndian.PutUint64(b[16:], h.sum)
}

func readHeader(b []byte) frameHeader {
	return frameHeader{runs: binary.LittleEndian.Uint32(b[0:]), kind: binary.LittleEndian.Uint32(b[4:]),
		length: binary.LittleEndian.Uint64(b[8:]), sum: binary.LittleEndian.Uint64(b[16:])}
}

func putRun(b []byte, region int, offset, length int64) {
	binary.LittleEndian.PutUint32(b[0:], uint32(region))
	binary.LittleEndian.PutUint64(b[4:], uint64(offset))
	binary.LittleEndian.PutUint64(b[12:], uint64(length))
}

func readRun(b []byte) (region uint32, offset, length uint64) {
	return binary.LittleEndian.Uint32(b[0:]), binary.LittleEndian.Uint64(b[4:]), binary.LittleEndian.Uint64(b[12:])
}

// ack is the target's answer to an end frame.
type ack struct {
	Frames      uint64 `json:"frames"`
	Bytes       uint64 `json:"bytes"`
	BadChecksum uint64 `json:"bad_checksum"`
	Error       string `json:"error,omitempty"`
	// Credit, on a carried connection, is how many frames the target has
	// taken out of their staging slots so far (a line before the final
	// acknowledgement, which has none).
	Credit uint64 `json:"credit,omitempty"`
}

// Memory is one side's KV as the data plane sees it: mapped regions and
// their layout.
type Memory struct {
	Data          [][]byte
	Specs         []kvlayout.RegionSpec
	Layers, Heads int
	SlotBytes     int64
	// Sink, when set, receives the runs instead of Data (KV the agent
	// cannot map: GPU memory, written through staging). It must copy the
	// bytes it is given; Flush makes everything written so far land and
	// is called before the share is acknowledged. A Sink that is an
	// io.Closer is closed when the connection ends.
	Sink Sink
	// Guard confines a target's writes to the migration's reserved
	// blocks. A target Memory without one is refused.
	Guard *kvlayout.BlockGuard
}

// Slot is the bytes of head vector (layer, kv, head, block, slot)
// wherever m's regions keep it; nil when no region holds that layer and
// head.
func (m *Memory) Slot(l, kv, h, b, s int) []byte {
	for i, r := range m.Specs {
		if l >= r.FirstLayer && l < r.FirstLayer+r.NumLayers && h >= r.FirstHead && h < r.FirstHead+r.NumHeads {
			st := r.Strides
			off := int64(l-r.FirstLayer)*st.Layer + int64(kv)*st.KV + int64(b)*st.Block + int64(h-r.FirstHead)*st.Head + int64(s)*st.Slot
			return m.Data[i][off : off+m.SlotBytes]
		}
	}
	return nil
}

// GuardBlocks is a guard that lets writes reach only the given blocks of
// m's regions (g: the KV's geometry) — what a target holding m in
// memory sets as its Guard.
func (m *Memory) GuardBlocks(g kvlayout.Geometry, blocks []int) (*kvlayout.BlockGuard, error) {
	sizes := make([]int64, len(m.Data))
	for i, d := range m.Data {
		sizes[i] = int64(len(d))
	}
	return kvlayout.NewBlockGuard(m.Specs, sizes, g.NumBlocks, g.BlockSize, m.SlotBytes, blocks)
}

// Sink takes a target's writes (see Memory.Sink).
type Sink interface {
	Write(region int, at uint64, b []byte) error
	Flush() error
}

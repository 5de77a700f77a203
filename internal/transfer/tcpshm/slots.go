package tcpshm

import (
	"encoding/binary"
	"fmt"
)

// slotPlace is where one (layer, K/V, head) lives: region, and the offset
// of block 0 slot 0 with the block and slot strides.
type slotPlace struct {
	region            int
	base, block, slot int64
}

// slotPlaces lists the places of every (layer, K/V, head) in canonical
// order for a memory's layout.
func slotPlaces(m *Memory) ([]slotPlace, error) {
	out := make([]slotPlace, 0, m.Layers*2*m.Heads)
	for l := 0; l < m.Layers; l++ {
		for kv := 0; kv < 2; kv++ {
			for h := 0; h < m.Heads; h++ {
				found := false
				for i, r := range m.Specs {
					if l >= r.FirstLayer && l < r.FirstLayer+r.NumLayers && h >= r.FirstHead && h < r.FirstHead+r.NumHeads {
						st := r.Strides
						out = append(out, slotPlace{region: i, base: int64(l-r.FirstLayer)*st.Layer + int64(kv)*st.KV + int64(h-r.FirstHead)*st.Head, block: st.Block, slot: st.Slot})
						found = true
						break
					}
				}
				if !found {
					return nil, fmt.Errorf("layer %d head %d is in no region", l, h)
				}
			}
		}
	}
	return out, nil
}

type slotJob struct {
	block, first, slots uint64
}

func readJob(b []byte) slotJob {
	return slotJob{block: uint64(binary.LittleEndian.Uint32(b[0:])), first: uint64(binary.LittleEndian.Uint32(b[4:])),
		slots: uint64(binary.LittleEndian.Uint32(b[8:]))}
}

// scatterSlots writes a slots frame's payload into memory. Every job is
// checked against the block guard and the payload's size before anything
// is written.
func scatterSlots(mem *Memory, places []slotPlace, jobs, payload []byte) error {
	var want uint64
	for k := 0; k+jobSize <= len(jobs); k += jobSize {
		j := readJob(jobs[k:])
		if err := mem.Guard.CheckSlots(j.block, j.first, j.slots); err != nil {
			return err
		}
		want += j.slots * uint64(mem.SlotBytes) * uint64(len(places)) // slots ≤ block size: no overflow
	}
	if want != uint64(len(payload)) {
		return fmt.Errorf("slot frame payload of %d bytes, jobs describe %d", len(payload), want)
	}
	slotBytes := mem.SlotBytes
	var off int64
	for k := 0; k+jobSize <= len(jobs); k += jobSize {
		j := readJob(jobs[k:])
		block, first, n := int64(j.block), int64(j.first), int64(j.slots)*slotBytes
		for _, p := range places {
			dst := mem.Data[p.region]
			at := p.base + block*p.block + first*p.slot
			if p.slot == slotBytes {
				if at < 0 || at+n > int64(len(dst)) {
					return fmt.Errorf("slot job outside the target regions (block %d)", block)
				}
				copy(dst[at:at+n], payload[off:off+n])
				off += n
				continue
			}
			for s := int64(0); s < int64(j.slots); s++ { // slots not packed: one at a time
				a := at + s*p.slot
				if a < 0 || a+slotBytes > int64(len(dst)) {
					return fmt.Errorf("slot job outside the target regions (block %d)", block)
				}
				copy(dst[a:a+slotBytes], payload[off:off+slotBytes])
				off += slotBytes
			}
		}
	}
	return nil
}

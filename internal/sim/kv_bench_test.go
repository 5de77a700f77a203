package sim

import (
	"testing"

	"github.com/cespare/xxhash/v2"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

func benchKV(b *testing.B) *kvMemory {
	c := DefaultConfig()
	geo, par, _ := c.geometry()
	m, err := newKVMemory(geo, par, false, "/dev/shm", "vhi-kvbench")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(m.close)
	return m
}

func BenchmarkWriteToken(b *testing.B) {
	m := benchKV(b)
	for i := 0; i < b.N; i++ {
		m.writeToken(1+i%4096/16, i%16, 7, 300, i)
	}
}

func BenchmarkHashFullBlock(b *testing.B) { benchHashSlots(b, 16) }

func BenchmarkHashPartialBlock(b *testing.B) { benchHashSlots(b, 9) }

// benchHashSlots hashes the first slots slots of a written block.
func benchHashSlots(b *testing.B, slots int) {
	m := benchKV(b)
	var d xxhash.Digest
	for i := 0; i < 64; i++ {
		m.writeToken(1+i/16, i%16, 7, 300, i)
	}
	for i := 0; i < b.N; i++ {
		d.Reset()
		m.hashSlots(&d, hostReader{m}, 1+i%4, slots, 0, 1)
	}
}

var _ = kvlayout.Run{}

func warm(m *kvMemory) {
	for blk := 1; blk <= 20000; blk++ {
		for s := 0; s < 16; s++ {
			m.writeToken(blk, s, 1, 1, s)
		}
	}
}

func BenchmarkWriteTokenScattered(b *testing.B) {
	m := benchKV(b)
	warm(m)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		m.writeToken(1+(i*7919)%20000, i%16, 7, 300, i)
	}
}

func BenchmarkHashFullScattered(b *testing.B) { benchHashScattered(b, 16) }

func BenchmarkHashPartialScattered(b *testing.B) { benchHashScattered(b, 9) }

// benchHashScattered hashes the first slots slots of blocks all over a
// warm KV.
func benchHashScattered(b *testing.B, slots int) {
	m := benchKV(b)
	warm(m)
	b.ResetTimer()
	var d xxhash.Digest
	for i := 0; i < b.N; i++ {
		d.Reset()
		m.hashSlots(&d, hostReader{m}, 1+(i*7919)%20000, slots, 0, 1)
	}
}

package kvsum

import (
	"math/rand/v2"
	"testing"
)

// The sum is the same whatever order its words are added in, and any
// single changed word, and any two words swapped, change it.
func TestTheSumIsOrderFreeAndSeesChanges(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	b := make([]byte, 4096)
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
	n := uint64(len(b) / 8)
	whole := Finish(Add(0, b, 0), n)
	// In two halves, the second first.
	if got := Finish(Add(Add(0, b[2048:], 256), b[:2048], 0), n); got != whole {
		t.Fatalf("halves in the other order: %x, whole: %x", got, whole)
	}
	for range 200 {
		c := append([]byte(nil), b...)
		c[rng.IntN(len(c))] ^= byte(1 + rng.IntN(255))
		if Finish(Add(0, c, 0), n) == whole {
			t.Fatal("a changed byte kept the hash")
		}
	}
	c := append([]byte(nil), b...)
	copy(c[0:8], b[8:16])
	copy(c[8:16], b[0:8])
	if Finish(Add(0, c, 0), n) == whole {
		t.Fatal("two swapped words kept the hash")
	}
	// All zeros is not all zeros' hash of another length, nor zero.
	z := make([]byte, 64)
	if Finish(Add(0, z, 0), 8) == Finish(Add(0, z[:56], 0), 7) || Finish(Add(0, z, 0), 8) == 0 {
		t.Fatal("zero words hash to nothing")
	}
}

// Term is what the GPU kernel adds (internal/cuda/kvsum.ptx): pinned, so
// that a change of the scheme on one side shows here before it shows as
// every migration's check failing between agents of two versions.
func TestTermIsPinned(t *testing.T) {
	for _, c := range []struct{ w, i, want uint64 }{
		{0, 0, 0},
		{0x0123456789ABCDEF, 5, 0xe05edbeedddaec57},
	} {
		if got := Term(c.w, c.i); got != c.want {
			t.Fatalf("Term(%#x, %d) = %#x, want %#x", c.w, c.i, got, c.want)
		}
	}
	if got := Finish(Term(7, 3), 1); got != 0x90be3e0e2ca67f95 {
		t.Fatalf("Finish = %#x", got)
	}
}

package cudaipc

import (
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// fakeDriver records copies into a byte-addressed fake device memory.
type fakeDriver struct {
	cuda.Driver
	mem     map[cuda.DevicePtr]byte
	calls   int
	synced  bool
	batches []int
	kernel  int
}

func (f *fakeDriver) CopyBatch(_ int, _ cuda.Stream, cs []cuda.Copy) error {
	f.calls++
	f.batches = append(f.batches, len(cs))
	for _, c := range cs {
		for i := uint64(0); i < c.Len; i++ {
			f.mem[c.Dst+cuda.DevicePtr(i)] = f.mem[c.Src+cuda.DevicePtr(i)]
		}
	}
	return nil
}

func (f *fakeDriver) Sync(int, cuda.Stream) error { f.synced = true; return nil }

func TestRunTranslatesRunsAndBatches(t *testing.T) {
	f := &fakeDriver{mem: map[cuda.DevicePtr]byte{}}
	src, dst := Regions{1000, 5000}, Regions{20000}
	for i := 0; i < 64; i++ {
		f.mem[src[1]+cuda.DevicePtr(i)] = byte(i + 1)
	}
	runs := []kvlayout.CopyRun{
		{SrcRegion: 1, SrcOffset: 0, DstRegion: 0, DstOffset: 100, Length: 8},
		{SrcRegion: 1, SrcOffset: 32, DstRegion: 0, DstOffset: 0, Length: 4},
		{SrcRegion: 1, SrcOffset: 60, DstRegion: 0, DstOffset: 50, Length: 4},
	}
	c := &Copier{Driver: f, MaxBatch: 2, Method: MethodBatch}
	if err := c.Run(src, dst, runs); err != nil {
		t.Fatal(err)
	}
	if f.calls != 2 || f.batches[0] != 2 || f.batches[1] != 1 || !f.synced {
		t.Fatalf("calls %d batches %v synced %v", f.calls, f.batches, f.synced)
	}
	for i, want := range map[cuda.DevicePtr]byte{20100: 1, 20107: 8, 20000: 33, 20053: 64} {
		if f.mem[i] != want {
			t.Fatalf("byte at %d = %d, want %d", i, f.mem[i], want)
		}
	}
	if err := c.Run(src, dst, []kvlayout.CopyRun{{SrcRegion: 2}}); err == nil {
		t.Fatal("a run naming a missing region was accepted")
	}
}

func (f *fakeDriver) KernelCopyFill(dev int, s cuda.Stream, n int, fill func([]cuda.Copy)) error {
	return f.KernelCopy(dev, s, cuda.FilledCopies(n, fill))
}

func (f *fakeDriver) KernelCopy(dev int, s cuda.Stream, cs []cuda.Copy) error {
	f.kernel++
	return f.CopyBatch(dev, s, cs)
}

// The default method is the kernel, one launch a Run, with long runs cut
// in pieces.
func TestAutoUsesTheKernelAndCutsLongRuns(t *testing.T) {
	f := &fakeDriver{mem: map[cuda.DevicePtr]byte{}}
	c := &Copier{Driver: f}
	if err := c.Run(Regions{0}, Regions{1 << 40}, []kvlayout.CopyRun{{Length: 16}, {SrcOffset: 64, DstOffset: 64, Length: 16}}); err != nil {
		t.Fatal(err)
	}
	if f.kernel != 1 {
		t.Fatalf("small runs: %d kernel launches", f.kernel)
	}
	f.batches = nil
	if err := c.Run(Regions{0}, Regions{1 << 40}, []kvlayout.CopyRun{{Length: 3 * kernelPiece / 2}}); err != nil {
		t.Fatal(err)
	}
	if len(f.batches) != 1 || f.batches[0] != 2 {
		t.Fatalf("a run of 1.5 pieces became batches %v, want one batch of 2 copies", f.batches)
	}

	// A round of more runs than a batched copy-engine call takes is still
	// one launch.
	f.batches, f.kernel = nil, 0
	many := make([]kvlayout.CopyRun, DefaultMaxBatch+5)
	for i := range many {
		many[i] = kvlayout.CopyRun{SrcOffset: int64(32 * i), DstOffset: int64(32 * i), Length: 16}
	}
	if err := c.Run(Regions{0}, Regions{1 << 40}, many); err != nil {
		t.Fatal(err)
	}
	if f.kernel != 1 || len(f.batches) != 1 || f.batches[0] != len(many) {
		t.Fatalf("%d runs: %d launches, batches %v; want one launch of all", len(many), f.kernel, f.batches)
	}
}

// recordDriver keeps the copies of the last KernelCopyFill, chunk by chunk.
type recordDriver struct {
	cuda.Driver
	chunks [][]cuda.Copy
}

func (r *recordDriver) KernelCopyFill(_ int, _ cuda.Stream, n int, fill func([]cuda.Copy)) error {
	r.chunks = nil
	return cuda.EachChunk(n, func(lo, hi int) error {
		c := make([]cuda.Copy, hi-lo)
		fill(c)
		r.chunks = append(r.chunks, c)
		return nil
	})
}

func (r *recordDriver) Sync(int, cuda.Stream) error { return nil }

// The kernel's descriptors, written chunk by chunk where the launch reads
// them, are the round's pieces in order: runs that straddle a chunk's end,
// long runs cut in pieces and empty runs skipped.
func TestKernelPiecesFillChunkAfterChunk(t *testing.T) {
	var runs []kvlayout.CopyRun
	for i := 0; i < 30000; i++ {
		n := int64(32 << 10)
		switch {
		case i%997 == 0:
			n = 5*kernelPiece/2 + 16 // three pieces
		case i%1009 == 0:
			n = 0
		}
		runs = append(runs, kvlayout.CopyRun{SrcRegion: i % 2, SrcOffset: int64(i) << 20, DstOffset: int64(i) << 21, Length: n})
	}
	src, dst := Regions{1 << 40, 2 << 40}, Regions{3 << 40}
	want, err := KernelCopies(src, dst, runs)
	if err != nil {
		t.Fatal(err)
	}
	r := &recordDriver{}
	if err := (&Copier{Driver: r}).Run(src, dst, runs); err != nil {
		t.Fatal(err)
	}
	var got []cuda.Copy
	for _, c := range r.chunks {
		got = append(got, c...)
	}
	if len(r.chunks) < 3 || len(got) != len(want) {
		t.Fatalf("%d copies in %d chunks, want %d in several", len(got), len(r.chunks), len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("copy %d: %+v, want %+v", i, got[i], want[i])
		}
	}
}

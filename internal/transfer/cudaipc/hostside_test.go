package cudaipc

import (
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

// descDriver does the host's part of cuda.Lib.KernelCopy (the alignment
// check and the descriptors' copy into their staging) and launches nothing.
type descDriver struct {
	cuda.Driver
	desc []cuda.Copy
}

func (f *descDriver) KernelCopyFill(dev int, s cuda.Stream, n int, fill func([]cuda.Copy)) error {
	return f.KernelCopy(dev, s, cuda.FilledCopies(n, fill))
}

func (f *descDriver) KernelCopy(_ int, _ cuda.Stream, cs []cuda.Copy) error {
	for _, c := range cs {
		if (uint64(c.Dst)|uint64(c.Src)|c.Len)%16 != 0 {
			return cuda.ErrUnaligned
		}
	}
	if len(f.desc) < len(cs) {
		f.desc = make([]cuda.Copy, 2*len(cs))
	}
	copy(f.desc, cs)
	return nil
}

func (f *descDriver) Sync(int, cuda.Stream) error { return nil }

// BenchmarkRunHostSide is the host's part of a cuda_ipc round of 400,000
// scattered 32 KiB runs (about an 8B-shaped round 0 of 5,500 blocks): on
// one H100 the kernel moves them in 9.2 ms, and the host's part came on
// top (2026-12-06: 14.5 ms there; on the 2-core VM 20.4 ms before the
// batch was sized once and the descriptors copied in one piece, 5–7 ms
// after).
func BenchmarkRunHostSide(b *testing.B) {
	runs := make([]kvlayout.CopyRun, 400000)
	for i := range runs {
		runs[i] = kvlayout.CopyRun{SrcOffset: int64(i) << 15, DstOffset: int64((i*7919)%400000) << 15, Length: 32768}
	}
	c := &Copier{Driver: &descDriver{}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := c.Run(Regions{1 << 40}, Regions{1 << 41}, runs); err != nil {
			b.Fatal(err)
		}
	}
}

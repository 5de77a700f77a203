package cuda

import (
	"bytes"
	"errors"
	"sync"
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/gpu"
)

// loadOrSkip loads the driver, or skips with the reason on machines
// without one (CI has no GPU: these run on the GPU machines).
func loadOrSkip(t *testing.T) *Lib {
	t.Helper()
	l, err := Load()
	if errors.Is(err, ErrUnavailable) {
		t.Skip("no GPU here: ", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

func TestUnavailableIsClear(t *testing.T) {
	l, err := Load()
	if err != nil {
		// Without a driver the error says so in the words users see.
		if !errors.Is(err, ErrUnavailable) || err.Error() != "unavailable: libcuda not found" {
			t.Fatalf("load without a driver: %v", err)
		}
		return
	}
	l.Close()
	if _, err := l.DeviceCount(); !errors.Is(err, ErrNotLoaded) {
		t.Fatalf("a closed reference answered: %v", err)
	}
}

func TestCopiesOnTheGPU(t *testing.T) {
	l := loadOrSkip(t)
	n, err := l.DeviceCount()
	if err != nil || n == 0 {
		t.Skip("no device: ", err)
	}
	const size = 4 << 20
	a, err := l.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Free(0, a)
	b, err := l.Alloc(n-1, size)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Free(n-1, b)
	host := make([]byte, size)
	for i := range host {
		host[i] = byte(i * 31)
	}
	if err := l.HtoD(0, a, host); err != nil {
		t.Fatal(err)
	}
	s, err := l.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.DestroyStream(0, s)
	// Swap the two halves into b, in pieces of 4 KiB and of lengths that
	// leave the per-warp kernel tails (a part of a 4 KiB chunk, less than
	// a warp's 512 bytes, a lone vector).
	var cs []Copy
	lengths := []uint64{4096, 16, 4112, 560, 12320, 496, 32768}
	for off, i := uint64(0), 0; off < size/2; i++ {
		n := min(lengths[i%len(lengths)], size/2-off)
		cs = append(cs, Copy{Dst: b + DevicePtr(size/2+off), Src: a + DevicePtr(off), Len: n},
			Copy{Dst: b + DevicePtr(off), Src: a + DevicePtr(size/2+off), Len: n})
		off += n
	}
	if err := l.EnablePeer(0, n-1); err != nil {
		t.Fatal(err)
	}
	for _, method := range []string{"batch", "loop", KernelPerCTA, KernelPerWarp} {
		// Reset b, so each method must move the bytes itself.
		if err := l.HtoD(n-1, b, make([]byte, size)); err != nil {
			t.Fatal(err)
		}
		l.ForceLoop = method == "loop"
		copyErr := l.CopyBatch(0, s, cs)
		if method == KernelPerCTA || method == KernelPerWarp {
			l.CopyKernel = method
			copyErr = l.KernelCopy(0, s, cs)
		}
		if copyErr != nil {
			t.Fatal(method, copyErr)
		}
		if err := l.Sync(0, s); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, size)
		if err := l.DtoH(n-1, got, b); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got[:size/2], host[size/2:]) || !bytes.Equal(got[size/2:], host[:size/2]) {
			t.Fatalf("copies (%s) did not land", method)
		}
	}
	// The same swap in pieces of 16-112 bytes (84,000 descriptors), their
	// descriptors written in chunks where each launch reads them: several
	// chunks, each a launch of its own.
	var small []Copy
	smallLengths := []uint64{16, 48, 32, 80, 16, 112}
	for off, i := uint64(0), 0; off < size/2; i++ {
		n := min(smallLengths[i%len(smallLengths)], size/2-off)
		small = append(small, Copy{Dst: b + DevicePtr(size/2+off), Src: a + DevicePtr(off), Len: n},
			Copy{Dst: b + DevicePtr(off), Src: a + DevicePtr(size/2+off), Len: n})
		off += n
	}
	for _, kernel := range []string{KernelPerCTA, KernelPerWarp} {
		for _, chunked := range []bool{false, true} {
			if err := l.HtoD(n-1, b, make([]byte, size)); err != nil {
				t.Fatal(err)
			}
			l.CopyKernel, l.ChunkedDescriptors = kernel, chunked
			next, calls := 0, 0
			if err := l.KernelCopyFill(0, s, len(small), func(chunk []Copy) {
				next += copy(chunk, small[next:])
				calls++
			}); err != nil {
				t.Fatal(kernel, chunked, err)
			}
			if err := l.Sync(0, s); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, size)
			if err := l.DtoH(n-1, got, b); err != nil {
				t.Fatal(err)
			}
			if next != len(small) || calls < 4 || !bytes.Equal(got[:size/2], host[size/2:]) || !bytes.Equal(got[size/2:], host[:size/2]) {
				t.Fatalf("%d small copies (%s, chunked %v; %d filled in %d chunks) did not land", len(small), kernel, chunked, next, calls)
			}
		}
	}
	l.ChunkedDescriptors = true
	if err := l.KernelCopyFill(0, s, 1, func(c []Copy) { c[0] = Copy{Dst: b + 8, Src: a, Len: 16} }); !errors.Is(err, ErrUnaligned) {
		t.Fatalf("an unaligned chunk: %v", err)
	}
	l.ChunkedDescriptors = false
	if err := l.KernelCopy(0, s, []Copy{{Dst: b + 8, Src: a, Len: 16}}); !errors.Is(err, ErrUnaligned) {
		t.Fatalf("an unaligned kernel copy: %v", err)
	}
	if _, err := l.IPCGet(0, a); err != nil {
		t.Fatal(err)
	}
	var ce *Error
	if _, err := l.Alloc(0, 1<<62); !errors.As(err, &ce) || ce.Name == "" {
		t.Fatalf("a huge allocation: %v", err)
	}
}

func TestFormatUUIDAsNVML(t *testing.T) {
	b := [16]byte{0x9a, 0x3f, 0x00, 0x01, 0xbe, 0xef, 0x00, 0x0a, 0x10, 0x20, 0xde, 0xad, 0xbe, 0xef, 0x00, 0x07}
	if got, want := FormatUUID(b), "GPU-9a3f0001-beef-000a-1020-deadbeef0007"; got != want {
		t.Fatalf("FormatUUID = %s, want %s", got, want)
	}
}

// CUDA's UUID of every visible GPU is the one NVML (and nvidia-smi) print
// for it: agents match the engines' GPUs by it across processes that
// number them differently.
func TestDeviceUUIDIsNVMLs(t *testing.T) {
	l := loadOrSkip(t)
	n, err := l.DeviceCount()
	if err != nil || n == 0 {
		t.Skip("no device: ", err)
	}
	inv := gpu.Discover(nil)
	defer inv.Close()
	known := map[string]bool{}
	for _, d := range inv.Devices {
		known[d.UUID] = true
	}
	for dev := 0; dev < n; dev++ {
		u, err := l.DeviceUUID(dev)
		if err != nil {
			t.Fatal(err)
		}
		if inv.Unavailable == "" && !known[u] {
			t.Errorf("GPU %d: CUDA says %s, NVML knows %v", dev, u, inv.Devices)
		}
		t.Logf("GPU %d: %s", dev, u)
	}
}

// Goroutines that launch copy kernels on one stream at once (a tcp_shm
// target's connections flushing into one GPU) each get their own copies
// done: the stream's descriptor buffer is not overwritten between one
// launch's upload and its kernel. Each goroutine copies its own piece
// pattern, so a launch that ran another's descriptors leaves its
// destination zero.
func TestConcurrentKernelCopiesOnOneStream(t *testing.T) {
	l := loadOrSkip(t)
	if n, err := l.DeviceCount(); err != nil || n == 0 {
		t.Skip("no device: ", err)
	}
	const workers, pieces, piece = 8, 256, 4096
	const size = workers * pieces * piece
	src, err := l.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Free(0, src)
	dst, err := l.Alloc(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Free(0, dst)
	host := make([]byte, size)
	for i := range host {
		host[i] = byte(i*7 + i/4096)
	}
	if err := l.HtoD(0, src, host); err != nil {
		t.Fatal(err)
	}
	s, err := l.NewStream(0)
	if err != nil {
		t.Fatal(err)
	}
	defer l.DestroyStream(0, s)
	for round := 0; round < 20; round++ {
		if err := l.HtoD(0, dst, make([]byte, size)); err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		errs := make(chan error, workers)
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Worker w copies its pieces one launch per few pieces,
				// reversed within its range.
				base := uint64(w * pieces * piece)
				for k := 0; k < pieces; k += 8 {
					var cs []Copy
					for j := k; j < k+8; j++ {
						cs = append(cs, Copy{Dst: dst + DevicePtr(base+uint64(pieces-1-j)*piece), Src: src + DevicePtr(base+uint64(j)*piece), Len: piece})
					}
					if err := l.KernelCopy(0, s, cs); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
		if err := l.Sync(0, s); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, size)
		if err := l.DtoH(0, got, dst); err != nil {
			t.Fatal(err)
		}
		for w := 0; w < workers; w++ {
			base := w * pieces * piece
			for j := 0; j < pieces; j++ {
				want := host[base+j*piece : base+(j+1)*piece]
				at := base + (pieces-1-j)*piece
				if !bytes.Equal(got[at:at+piece], want) {
					t.Fatalf("round %d: worker %d's piece %d did not land", round, w, j)
				}
			}
		}
	}
}

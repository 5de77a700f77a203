package rdma

import (
	"bytes"
	"errors"
	"os"
	"testing"
	"time"
	"unsafe"
)

// loadUCX loads libucp or skips: UCX is a run-time dependency (CI
// installs Debian's libucx0, see the Makefile's ucx target).
func loadUCX(t testing.TB) *Lib {
	t.Helper()
	l, err := Load()
	if errors.Is(err, ErrUnavailable) && os.Getenv("VHI_REQUIRE_UCX") == "" {
		t.Skip(err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// progressUntil progresses w on its own goroutine until stop is closed.
func progressUntil(w *Worker, stop <-chan struct{}) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if !w.Progress() {
				time.Sleep(10 * time.Microsecond)
			}
		}
	}()
	return done
}

func TestPutBetweenTwoWorkers(t *testing.T) {
	l := loadUCX(t)
	c, err := l.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	t.Logf("UCX %s", l.Version())
	target := cMem(t, 1<<20)
	source := cMem(t, 1<<20)
	for i := range source {
		source[i] = byte(i * 7)
	}
	reg, err := c.Register(unsafe.Pointer(&target[0]), len(target))
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()
	tw, err := c.NewWorker()
	if err != nil {
		t.Fatal(err)
	}
	defer tw.Close()
	addr, err := tw.Address()
	if err != nil {
		t.Fatal(err)
	}
	sw, err := c.NewWorker()
	if err != nil {
		t.Fatal(err)
	}
	defer sw.Close()
	stop := make(chan struct{})
	done := progressUntil(tw, stop)
	defer func() { close(stop); <-done }()
	ep, err := sw.Connect(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	key, err := ep.Unpack(reg.Key)
	if err != nil {
		t.Fatal(err)
	}
	defer key.Close()
	// Two spans: the first 64 KiB to offset 128 KiB, 100 bytes to the end.
	puts := []Put{
		{Local: unsafe.Pointer(&source[0]), Len: 64 << 10, Remote: uint64(reg.Base) + 128<<10},
		{Local: unsafe.Pointer(&source[1000]), Len: 100, Remote: uint64(reg.Base) + uint64(len(target)) - 100},
	}
	if err := ep.PutFlush(key, puts, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(target[128<<10:192<<10], source[:64<<10]) || !bytes.Equal(target[len(target)-100:], source[1000:1100]) {
		t.Fatal("the target does not hold what was put")
	}
	if target[0] != 0 || target[128<<10-1] != 0 {
		t.Fatal("a put wrote outside its span")
	}
}

// cMem is n zeroed bytes of C memory, freed at the test's end.
func cMem(t testing.TB, n int) []byte {
	b := CAlloc(n)
	t.Cleanup(func() { CFree(b) })
	return b
}

package cudaipc

import (
	"bytes"
	"context"
	"fmt"
	"sort"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// memDriver is device memory made of host byte slices: enough to test the
// staging logic without a GPU (the H200 runs test the real driver).
type memDriver struct {
	cuda.Driver
	mu    sync.Mutex // the tcp_shm server calls in from its own goroutines
	next  cuda.DevicePtr
	bases []cuda.DevicePtr
	mem   map[cuda.DevicePtr][]byte
}

func newMemDriver() *memDriver { return &memDriver{next: 1 << 32, mem: map[cuda.DevicePtr][]byte{}} }

func (m *memDriver) Alloc(_ int, n uint64) (cuda.DevicePtr, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	p := m.next
	m.next += cuda.DevicePtr(n+4095) &^ 4095
	m.mem[p] = make([]byte, n)
	m.bases = append(m.bases, p)
	sort.Slice(m.bases, func(i, j int) bool { return m.bases[i] < m.bases[j] })
	return p, nil
}

func (m *memDriver) Free(_ int, p cuda.DevicePtr) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.mem, p)
	return nil
}

// at is the host view of n device bytes at p.
func (m *memDriver) at(p cuda.DevicePtr, n uint64) []byte {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i := len(m.bases) - 1; i >= 0; i-- {
		b := m.bases[i]
		if b <= p {
			buf, ok := m.mem[b]
			if !ok || uint64(p-b)+n > uint64(len(buf)) {
				panic(fmt.Sprintf("device access out of bounds at %#x+%d", p, n))
			}
			return buf[p-b : uint64(p-b)+n]
		}
	}
	panic("device access below every allocation")
}

func (m *memDriver) HostAlloc(_ int, n uint64) ([]byte, error) { return make([]byte, n), nil }
func (m *memDriver) HostFree(int, []byte) error                { return nil }
func (m *memDriver) HtoDAsync(_ int, _ cuda.Stream, d cuda.DevicePtr, b []byte) error {
	copy(m.at(d, uint64(len(b))), b)
	return nil
}
func (m *memDriver) DtoHAsync(_ int, _ cuda.Stream, b []byte, s cuda.DevicePtr) error {
	copy(b, m.at(s, uint64(len(b))))
	return nil
}
func (m *memDriver) CopyBatch(_ int, _ cuda.Stream, cs []cuda.Copy) error {
	for _, c := range cs {
		copy(m.at(c.Dst, c.Len), m.at(c.Src, c.Len))
	}
	return nil
}
func (m *memDriver) KernelCopyFill(dev int, s cuda.Stream, n int, fill func([]cuda.Copy)) error {
	return m.KernelCopy(dev, s, cuda.FilledCopies(n, fill))
}

func (m *memDriver) KernelCopy(d int, s cuda.Stream, cs []cuda.Copy) error {
	return m.CopyBatch(d, s, cs)
}
func (m *memDriver) Sync(int, cuda.Stream) error { return nil }

// GPU KV moved over tcp_shm: gathered from the source's GPU regions into
// pinned memory, sent as ordinary runs, staged and scattered into the
// target's GPU regions — the runs' bytes arrive, nothing else changes.
func TestGPUKVOverTCPShm(t *testing.T) {
	d := newMemDriver()
	const size = 1 << 20
	var src, dst Regions
	for i := 0; i < 2; i++ {
		p, _ := d.Alloc(0, size)
		for j := range d.mem[p] {
			d.mem[p][j] = byte(j*7 + i*13 + 1)
		}
		src = append(src, p)
		q, _ := d.Alloc(0, size)
		dst = append(dst, q)
	}
	runs := []kvlayout.CopyRun{
		{SrcRegion: 0, SrcOffset: 4096, DstRegion: 1, DstOffset: 0, Length: 8192},
		{SrcRegion: 1, SrcOffset: 0, DstRegion: 0, DstOffset: 65536, Length: 256},
		{SrcRegion: 1, SrcOffset: 999424, DstRegion: 1, DstOffset: 500000, Length: 48},
	}
	source := &Copier{Driver: d, Method: MethodKernel}
	host, sendRuns, err := source.Gather(src, runs)
	if err != nil {
		t.Fatal(err)
	}
	sink, err := NewSink(&Copier{Driver: d}, dst, []uint64{size, size})
	if err != nil {
		t.Fatal(err)
	}
	// Two regions of K and V planes of 128 blocks of 4 KiB, every block
	// open to writes.
	spec := kvlayout.RegionSpec{NumLayers: 1, NumHeads: 1, Strides: kvlayout.Strides{KV: size / 2, Block: 4096, Slot: 16}}
	all := make([]int, 128)
	for i := range all {
		all[i] = i
	}
	guard, err := kvlayout.NewBlockGuard([]kvlayout.RegionSpec{spec, spec}, []int64{size, size}, 128, 256, 16, all)
	if err != nil {
		t.Fatal(err)
	}
	secret := []byte("a secret of sixteen bytes or more")
	srv, err := tcpshm.Listen("127.0.0.1:0", func(string) (*tcpshm.Session, error) {
		return &tcpshm.Session{Secret: secret, Expires: time.Now().Add(time.Minute),
			Open: func() (*tcpshm.Memory, error) { return &tcpshm.Memory{Sink: sink, Guard: guard}, nil }}, nil
	}, tcpshm.Options{}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if _, err := tcpshm.Send(context.Background(), tcpshm.Dest{Addr: srv.Addr().String(), Session: "s", Secret: secret}, 1, [][]byte{host}, sendRuns, transfer.NoFault); err != nil {
		t.Fatal(err)
	}
	for _, r := range runs {
		want := d.at(src[r.SrcRegion]+cuda.DevicePtr(r.SrcOffset), uint64(r.Length))
		got := d.at(dst[r.DstRegion]+cuda.DevicePtr(r.DstOffset), uint64(r.Length))
		if !bytes.Equal(got, want) {
			t.Fatalf("run %+v did not arrive", r)
		}
	}
	if d.at(dst[1]+8192, 1)[0] != 0 || d.at(dst[0], 1)[0] != 0 {
		t.Fatal("bytes outside the runs changed")
	}
	if err := sink.Write(2, 0, []byte{1}); err == nil {
		t.Fatal("a write to a missing region was accepted")
	}
	if err := sink.Write(0, size-1, []byte{1, 2}); err == nil {
		t.Fatal("a write past a region's end was accepted")
	}
	if err := sink.Write(0, 1<<64-1, []byte{1}); err == nil {
		t.Fatal("a write at offset 2^64-1 was accepted (the bound wrapped around)")
	}
}

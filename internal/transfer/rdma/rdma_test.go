package rdma

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

var testSecret = []byte("0123456789abcdef0123456789abcdef")

// A geometry whose blocks are 512 KiB, so that a round of 40 blocks is
// more frames than the target has staging slots (the credits matter).
var testGeo = kvlayout.Geometry{Layers: 8, KVHeads: 8, HeadDim: 128, DTypeBytes: 2, BlockSize: 16, NumBlocks: 64}

func openPlane(t testing.TB) *Plane {
	t.Helper()
	loadUCX(t) // skips where UCX is missing
	p, err := Open()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

func memoryOf(g kvlayout.Geometry, par kvlayout.Parallel, seed uint64) *tcpshm.Memory {
	m := &tcpshm.Memory{Layers: g.Layers, Heads: g.KVHeads, SlotBytes: int64(g.HeadSlotBytes())}
	rng := rand.New(rand.NewPCG(seed, 1))
	for _, sh := range kvlayout.Shards(par) {
		r := kvlayout.NewRegionLayout(g, sh)
		b := make([]byte, r.Size())
		if seed != 0 {
			for i := 0; i < len(b); i += 8 {
				v := rng.Uint64()
				for k := 0; k < 8 && i+k < len(b); k++ {
					b[i+k] = byte(v >> (8 * k))
				}
			}
		}
		m.Data = append(m.Data, b)
		m.Specs = append(m.Specs, r.Spec())
	}
	return m
}

func guardOf(t testing.TB, g kvlayout.Geometry, m *tcpshm.Memory, blocks []int) *kvlayout.BlockGuard {
	t.Helper()
	gd, err := m.GuardBlocks(g, blocks)
	if err != nil {
		t.Fatal(err)
	}
	return gd
}

// serve runs a tcp_shm data server that offers the rdma carrier (when p
// is set) and holds session "mig-1" for dst.
func serve(t testing.TB, p *Plane, dst *tcpshm.Memory) string {
	t.Helper()
	opt := tcpshm.Options{}
	if p != nil {
		opt.Receivers = map[string]tcpshm.NewReceiver{Mode: p.NewReceiver}
	}
	srv, err := tcpshm.Listen("127.0.0.1:0", func(s string) (*tcpshm.Session, error) {
		if s != "mig-1" {
			return nil, fmt.Errorf("no migration %q is expected here", s)
		}
		return &tcpshm.Session{Secret: testSecret, Expires: time.Now().Add(time.Minute), Open: func() (*tcpshm.Memory, error) { return dst, nil }}, nil
	}, opt, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv.Addr().String()
}

// reserveFor guards dst to the target blocks of copies.
func reserveFor(t testing.TB, dst *tcpshm.Memory, copies []kvlayout.BlockCopy) {
	t.Helper()
	var blocks []int
	for _, c := range copies {
		blocks = append(blocks, c.Dst)
	}
	dst.Guard = guardOf(t, testGeo, dst, blocks)
}

// slotBytes reads (layer, kv, head, block, slot) wherever m's layout keeps it.
func slotBytes(m *tcpshm.Memory, l, kv, h, b, s int) []byte {
	if v := m.Slot(l, kv, h, b, s); v != nil {
		return v
	}
	panic("not held")
}

// copiesOf is n whole-block copies (source 2i+1 → target i), or, with
// slots, the last three slots of each.
func copiesOf(n int, slots bool) []kvlayout.BlockCopy {
	var out []kvlayout.BlockCopy
	for i := 0; i < n; i++ {
		c := kvlayout.BlockCopy{Src: (2*i + 1) % testGeo.NumBlocks, Dst: i + 1, NumSlots: testGeo.BlockSize}
		if slots {
			c.FirstSlot, c.NumSlots = testGeo.BlockSize-3, 3
		}
		out = append(out, c)
	}
	return out
}

func send(ctx context.Context, p *Plane, addr string, src, dst *tcpshm.Memory, copies []kvlayout.BlockCopy, slots bool, fault transfer.Fault) (transfer.Stats, error) {
	d := tcpshm.Dest{Addr: addr, Session: "mig-1", Secret: testSecret, Carrier: p}
	if slots {
		return tcpshm.SendSlots(ctx, d, 3, src, copies, fault)
	}
	runs, err := kvlayout.Plan(testGeo.Layers, testGeo.KVHeads, src.SlotBytes, src.Specs, dst.Specs, copies)
	if err != nil {
		return transfer.Stats{}, err
	}
	return tcpshm.Send(ctx, d, 3, src.Data, runs, fault)
}

func checkLanded(t *testing.T, src, dst *tcpshm.Memory, copies []kvlayout.BlockCopy) {
	t.Helper()
	g := testGeo
	for _, c := range copies {
		for l := 0; l < g.Layers; l++ {
			for kv := 0; kv < 2; kv++ {
				for h := 0; h < g.KVHeads; h++ {
					for s := c.FirstSlot; s < c.FirstSlot+c.NumSlots; s++ {
						if !bytes.Equal(slotBytes(src, l, kv, h, c.Src, s), slotBytes(dst, l, kv, h, c.Dst, s)) {
							t.Fatalf("block %d → %d, layer %d kv %d head %d slot %d: the target does not hold the source's bytes", c.Src, c.Dst, l, kv, h, s)
						}
					}
				}
			}
		}
	}
}

// Whole blocks and token slots land exactly through UCX puts into the
// target's staging, across TP/PP shapes and three connections, with more
// frames than staging slots.
func TestRoundsLandExactly(t *testing.T) {
	p := openPlane(t)
	src := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 7)
	for _, par := range []kvlayout.Parallel{{TP: 1, PP: 1}, {TP: 2, PP: 2}} {
		for _, slots := range []bool{false, true} {
			t.Run(fmt.Sprintf("tp%d-pp%d-slots=%v", par.TP, par.PP, slots), func(t *testing.T) {
				dst := memoryOf(testGeo, par, 0)
				copies := copiesOf(40, slots)
				reserveFor(t, dst, copies)
				addr := serve(t, p, dst)
				st, err := send(context.Background(), p, addr, src, dst, copies, slots, transfer.NoFault)
				if err != nil {
					t.Fatal(err)
				}
				if st.Bytes == 0 {
					t.Fatal("no bytes reported")
				}
				checkLanded(t, src, dst, copies)
			})
		}
	}
}

// The aborts of tcp_shm hold on the carrier: a frame damaged after its
// checksum is reported, a cut connection fails, a write outside the
// reserved blocks is refused before it lands, and a target without the
// carrier refuses it. (Silent corruption — wrong bytes that check out —
// is the Host's end-to-end check's to catch, tested end to end.)
func TestAborts(t *testing.T) {
	p := openPlane(t)
	src := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 7)
	copies := copiesOf(12, false)
	for _, tc := range []struct {
		name  string
		fault transfer.Fault
		want  string
	}{{"corrupt", transfer.CorruptFrame, "bad checksum"}, {"cut", transfer.CutConn, "connection cut"}} {
		t.Run(tc.name, func(t *testing.T) {
			dst := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 0)
			reserveFor(t, dst, copies)
			_, err := send(context.Background(), p, serve(t, p, dst), src, dst, copies, false, tc.fault)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want an error with %q, got %v", tc.want, err)
			}
		})
	}
	t.Run("outside the reserved blocks", func(t *testing.T) {
		dst := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 0)
		dst.Guard = guardOf(t, testGeo, dst, []int{1})
		_, err := send(context.Background(), p, serve(t, p, dst), src, dst, copies, false, transfer.NoFault)
		if err == nil {
			t.Fatal("a round into unreserved blocks succeeded")
		}
		for c := range copies[1:] {
			for _, b := range slotBytes(dst, 0, 0, 0, copies[1+c].Dst, 0) {
				if b != 0 {
					t.Fatalf("block %d, outside the reservation, was written", copies[1+c].Dst)
				}
			}
		}
	})
	t.Run("target without the carrier", func(t *testing.T) {
		dst := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 0)
		reserveFor(t, dst, copies)
		_, err := send(context.Background(), p, serve(t, nil, dst), src, dst, copies, false, transfer.NoFault)
		if err == nil || !strings.Contains(err.Error(), "no rdma data plane") {
			t.Fatalf("want the target's refusal, got %v", err)
		}
	})
}

package transfer

import (
	"errors"
	"fmt"
	"reflect"
	"testing"

	"github.com/vllm-hi/vllm-hi/api/hooks"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
)

func running(id string, computed int, blocks ...int) hooks.RequestInfo {
	return hooks.RequestInfo{RequestID: id, Status: hooks.StatusRunning, NumComputedTokens: computed, BlockIDs: blocks}
}

func TestPlanRound(t *testing.T) {
	const bs = 4
	for _, c := range []struct {
		name    string
		kind    string
		moving  []Moving
		live    []hooks.RequestInfo
		written []hooks.BlockWrite
		slots   bool
		copies  []kvlayout.BlockCopy
		dropped []string
		slotsN  int
	}{
		{
			name:   "full copies the blocks with computed tokens, sorted by source block",
			kind:   KindFull,
			moving: []Moving{{ID: "b", Dst: []int{20, 21, 22}}, {ID: "a", Dst: []int{10, 11}}},
			live:   []hooks.RequestInfo{running("a", 5, 7, 3), running("b", 4, 9, 1, 2), running("other", 8, 5, 6)},
			copies: []kvlayout.BlockCopy{{Src: 3, Dst: 11, NumSlots: bs}, {Src: 7, Dst: 10, NumSlots: bs}, {Src: 9, Dst: 20, NumSlots: bs}},
			slotsN: 3 * bs,
		},
		{
			name:   "incremental copies what moving requests wrote, whole blocks",
			kind:   KindIncremental,
			moving: []Moving{{ID: "a", Src: []int{7}, Dst: []int{10, 11}}},
			live:   []hooks.RequestInfo{running("a", 6, 7, 3), running("other", 8, 5)},
			written: []hooks.BlockWrite{{Block: 3, FirstSlot: 0, NumSlots: 2, RequestID: "a"}, {Block: 5, NumSlots: 1, RequestID: "other"},
				{Block: 7, FirstSlot: 3, NumSlots: 1, RequestID: "a"}},
			copies: []kvlayout.BlockCopy{{Src: 3, Dst: 11, NumSlots: bs}, {Src: 7, Dst: 10, NumSlots: bs}},
			slotsN: 2 * bs,
		},
		{
			name:    "the final round copies just the slots written",
			kind:    KindFinal,
			moving:  []Moving{{ID: "a", Src: []int{7, 3}, Dst: []int{10, 11}}},
			live:    []hooks.RequestInfo{running("a", 7, 7, 3)},
			written: []hooks.BlockWrite{{Block: 3, FirstSlot: 2, NumSlots: 1, RequestID: "a"}},
			slots:   true,
			copies:  []kvlayout.BlockCopy{{Src: 3, Dst: 11, FirstSlot: 2, NumSlots: 1}},
			slotsN:  1,
		},
		{
			name: "a prefix shared on both sides goes once",
			kind: KindFull,
			moving: []Moving{{ID: "a", Dst: []int{10, 11, 12}}, {ID: "b", Dst: []int{10, 11, 20}},
				{ID: "c", Dst: []int{10, 30}}},
			live:   []hooks.RequestInfo{running("a", 10, 1, 2, 3), running("b", 9, 1, 2, 4), running("c", 5, 1, 5)},
			copies: []kvlayout.BlockCopy{{Src: 1, Dst: 10, NumSlots: bs}, {Src: 2, Dst: 11, NumSlots: bs}, {Src: 3, Dst: 12, NumSlots: bs}, {Src: 4, Dst: 20, NumSlots: bs}, {Src: 5, Dst: 30, NumSlots: bs}},
			slotsN: 5 * bs,
		},
		{
			name:   "a prefix shared on the source only goes to each target block",
			kind:   KindFull,
			moving: []Moving{{ID: "a", Dst: []int{10, 11}}, {ID: "b", Dst: []int{20, 21}}},
			live:   []hooks.RequestInfo{running("a", 6, 1, 2), running("b", 5, 1, 3)},
			copies: []kvlayout.BlockCopy{{Src: 1, Dst: 10, NumSlots: bs}, {Src: 1, Dst: 20, NumSlots: bs}, {Src: 2, Dst: 11, NumSlots: bs}, {Src: 3, Dst: 21, NumSlots: bs}},
			slotsN: 4 * bs,
		},
		{
			name:   "a write to a shared block goes wherever a moving request holds it, whoever wrote it",
			kind:   KindIncremental,
			moving: []Moving{{ID: "b", Src: []int{1}, Dst: []int{20, 21}}, {ID: "c", Src: []int{1}, Dst: []int{20, 31}}},
			live:   []hooks.RequestInfo{running("a", 8, 1, 2), running("b", 5, 1, 3), running("c", 5, 1, 4)},
			written: []hooks.BlockWrite{{Block: 1, FirstSlot: 3, NumSlots: 1, RequestID: "a"}, {Block: 3, NumSlots: 1, RequestID: "b"},
				{Block: 4, NumSlots: 1, RequestID: "c"}},
			copies: []kvlayout.BlockCopy{{Src: 1, Dst: 20, NumSlots: bs}, {Src: 3, Dst: 21, NumSlots: bs}, {Src: 4, Dst: 31, NumSlots: bs}},
			slotsN: 3 * bs,
		},
		{
			name:    "a block freed and taken by another request is not copied",
			kind:    KindIncremental,
			moving:  []Moving{{ID: "a", Src: []int{7}, Dst: []int{10, 11}}},
			live:    []hooks.RequestInfo{running("a", 4, 7), running("b", 1, 3)},
			written: []hooks.BlockWrite{{Block: 3, NumSlots: 1, RequestID: "b"}},
		},
		{
			name: "requests that finished, wait, outgrew their reservation or were preempted drop out",
			kind: KindIncremental,
			moving: []Moving{{ID: "gone", Dst: []int{1}}, {ID: "waiting", Dst: []int{2}}, {ID: "big", Dst: []int{3}},
				{ID: "preempted", Src: []int{4, 5}, Dst: []int{6, 7}}, {ID: "shrunk", Src: []int{8, 9}, Dst: []int{10, 11}}},
			live: []hooks.RequestInfo{{RequestID: "waiting", Status: hooks.StatusWaiting}, running("big", 8, 12, 13),
				running("preempted", 2, 4, 14), running("shrunk", 2, 8)},
			dropped: []string{"gone", "waiting", "big", "preempted", "shrunk"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := PlanRound(c.kind, c.moving, c.live, c.written, bs, c.slots)
			if !reflect.DeepEqual(p.Copies, c.copies) || !reflect.DeepEqual(p.Dropped, c.dropped) || p.TokenSlots != c.slotsN {
				t.Fatalf("copies %+v dropped %v slots %d; want %+v %v %d", p.Copies, p.Dropped, p.TokenSlots, c.copies, c.dropped, c.slotsN)
			}
			if len(p.Moving)+len(p.Dropped) != len(c.moving) {
				t.Fatalf("moving %+v", p.Moving)
			}
			for _, mv := range p.Moving {
				for _, r := range c.live {
					if r.RequestID == mv.ID && !reflect.DeepEqual(mv.Src, []int(r.BlockIDs)) {
						t.Fatalf("%s's source table %v, want %v", mv.ID, mv.Src, r.BlockIDs)
					}
				}
			}
		})
	}
}

func gpu(node string) hooks.Layout {
	return hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryCUDAIPC, Node: node}}}}
}

func TestPick(t *testing.T) {
	host := hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryShm}}}}
	far := gpu("another-node")
	for _, c := range []struct {
		want     string
		src, dst hooks.Layout
		got      string
	}{
		{"", gpu(""), gpu(""), CUDAIPC},
		{Auto, gpu(""), gpu(""), CUDAIPC},
		{Auto, gpu(""), host, TCPShm},
		{Auto, host, host, TCPShm},
		{Auto, gpu(""), far, TCPShm},
		{TCPShm, gpu(""), gpu(""), TCPShm},
		{CUDAIPC, gpu(""), gpu(""), CUDAIPC},
		{CUDAIPC, host, gpu(""), ""},
		{CUDAIPC, gpu(""), far, ""},
		{RDMA, host, host, ""},
		{"carrier-pigeon", host, host, ""},
	} {
		got, why, err := Pick(c.want, c.src, c.dst, RDMAPeers{})
		if got != c.got || (c.got == "") != errors.Is(err, ErrUnsupported) || (c.got != "") == (why == "") {
			t.Errorf("Pick(%q, %s → %s) = %q, %v; want %q", c.want, kind(c.src), kind(c.dst), got, err, c.got)
		}
	}
}

// With both agents' rdma planes: rdma when asked for (ucx too), and by
// auto across machines only where both have an RDMA device.
func TestPickRDMA(t *testing.T) {
	host := hooks.Layout{Regions: []hooks.Region{{Memory: hooks.Memory{Kind: hooks.MemoryShm}}}}
	nic := func(node string, devs ...string) *RDMAPlane { return &RDMAPlane{Hostname: node, Devices: devs} }
	for _, c := range []struct {
		name     string
		want     string
		src, dst hooks.Layout
		peers    RDMAPeers
		got      string
	}{
		{"asked for, no UCX on the source", RDMA, host, host, RDMAPeers{Target: nic("b")}, ""},
		{"asked for, no UCX on the target", RDMA, host, host, RDMAPeers{Source: nic("a")}, ""},
		{"asked for over TCP", RDMA, host, host, RDMAPeers{Source: nic("a"), Target: nic("a")}, RDMA},
		{"the alias", UCX, host, host, RDMAPeers{Source: nic("a"), Target: nic("b")}, RDMA},
		{"asked for with GPU KV (staged)", RDMA, gpu(""), gpu(""), RDMAPeers{Source: nic("a"), Target: nic("a")}, RDMA},
		{"auto across nodes with NICs", Auto, host, host, RDMAPeers{Source: nic("a", "mlx5_0:1"), Target: nic("b", "mlx5_0:1")}, RDMA},
		{"auto across nodes, GPUs, NICs", Auto, gpu(""), gpu(""), RDMAPeers{Source: nic("a", "mlx5_0:1"), Target: nic("b", "mlx5_2:1")}, RDMA},
		{"auto across nodes, one NIC", Auto, host, host, RDMAPeers{Source: nic("a", "mlx5_0:1"), Target: nic("b")}, TCPShm},
		{"auto on one node keeps cuda_ipc", Auto, gpu(""), gpu(""), RDMAPeers{Source: nic("a", "mlx5_0:1"), Target: nic("a", "mlx5_0:1")}, CUDAIPC},
		{"auto across nodes without UCX", Auto, host, host, RDMAPeers{}, TCPShm},
	} {
		got, why, err := Pick(c.want, c.src, c.dst, c.peers)
		if got != c.got || (c.got == "") != errors.Is(err, ErrUnsupported) || (c.got != "") == (why == "") {
			t.Errorf("%s: Pick = %q (%s), %v; want %q", c.name, got, why, err, c.got)
		}
	}
}

func kind(l hooks.Layout) string {
	return fmt.Sprintf("%s@%s", l.Regions[0].Memory.Kind, l.Regions[0].Memory.Node)
}

func TestParseFault(t *testing.T) {
	for s, f := range map[string]Fault{"": NoFault, "corrupt": CorruptFrame, "cut": CutConn, "silent_corrupt": CorruptSilently, "crash_after_pause": NoFault} {
		if ParseFault(s) != f {
			t.Errorf("%q: %v", s, ParseFault(s))
		}
	}
}

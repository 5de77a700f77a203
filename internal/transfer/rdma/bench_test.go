package rdma

import (
	"context"
	"testing"

	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer"
	"github.com/vllm-hi/vllm-hi/internal/transfer/tcpshm"
)

// One round of 60 whole 512 KiB blocks (30 MiB) over 2 connections, by
// UCX puts and by tcp_shm's stream, on loopback side by side:
//
//	go test -run xxx -bench Round ./internal/transfer/rdma/
func BenchmarkRound(b *testing.B) {
	p := openPlane(b)
	src := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 7)
	dst := memoryOf(testGeo, kvlayout.Parallel{TP: 1, PP: 1}, 0)
	copies := copiesOf(60, false)
	reserveFor(b, dst, copies)
	addr := serve(b, p, dst)
	runs, err := kvlayout.Plan(testGeo.Layers, testGeo.KVHeads, src.SlotBytes, src.Specs, dst.Specs, copies)
	if err != nil {
		b.Fatal(err)
	}
	for _, c := range []struct {
		name    string
		carrier tcpshm.Carrier
	}{{"tcp_shm", nil}, {"rdma", p}} {
		b.Run(c.name, func(b *testing.B) {
			d := tcpshm.Dest{Addr: addr, Session: "mig-1", Secret: testSecret, Carrier: c.carrier}
			b.SetBytes(kvlayout.Bytes(runs))
			for i := 0; i < b.N; i++ {
				if _, err := tcpshm.Send(context.Background(), d, 2, src.Data, runs, transfer.NoFault); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

package sim

import "testing"

func TestBlockPool(t *testing.T) {
	p := newBlockPool(9, 4)
	if p.total() != 8 || p.numFree() != 8 {
		t.Fatalf("total %d free %d", p.total(), p.numFree())
	}
	a, ok := p.allocate(5, "a")
	if !ok || a[0] != 1 || len(a) != 5 {
		t.Fatalf("allocate: %v %v", a, ok)
	}
	if _, ok := p.allocate(4, "b"); ok {
		t.Fatal("over-allocation succeeded")
	}
	if p.numFree() != 3 {
		t.Fatal("a failed allocation must take nothing")
	}
	p.release(a[:2], 7)
	// FIFO: the never-used blocks 6..8 come before the freed 1, 2.
	b, _ := p.allocate(4, "b")
	if b[0] != 6 || b[3] != 1 {
		t.Fatalf("free-queue order: %v", b)
	}
	if p.freeGen[2] != 7 || p.owner[b[0]] != "b" {
		t.Fatal("generation/owner bookkeeping")
	}
	for _, x := range append(a, b...) {
		if x == 0 {
			t.Fatal("null block handed out")
		}
	}
	p.markWritten(3, 1, 10)
	p.markWritten(3, 2, 11)
	if f, n := p.changedSlots(3, 10); f != 2 || n != 1 {
		t.Fatalf("changed since 10: %d+%d", f, n)
	}
	if f, n := p.changedSlots(3, 9); f != 1 || n != 2 {
		t.Fatalf("changed since 9: %d+%d", f, n)
	}
	if _, n := p.changedSlots(3, 11); n != 0 {
		t.Fatal("nothing changed since 11")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("double free not caught")
		}
	}()
	p.release([]int{2}, 12)
}

package rdma

import (
	"reflect"
	"testing"
)

func TestParseResources(t *testing.T) {
	// The shape of ucp_context_print_info on a host with a ConnectX NIC
	// and a CUDA-enabled UCX.
	info := `#
# UCP context
#
#            md 0  :  component 0  self
#      resource 0  :  md 0  dev 0  flags -- self/memory0
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 2  dev 2  flags -- rc_mlx5/mlx5_0:1
#      resource 3  :  md 2  dev 2  flags -- ud_verbs/mlx5_0:1
#      resource 4  :  md 3  dev 3  flags -- dc_mlx5/mlx5_1:1
#      resource 5  :  md 4  dev 4  flags -- cuda_copy/cuda
#
`
	got := ParseResources(info)
	want := Resources{Transports: []string{"self/memory0", "tcp/eth0", "rc_mlx5/mlx5_0:1", "ud_verbs/mlx5_0:1", "dc_mlx5/mlx5_1:1", "cuda_copy/cuda"},
		RDMA: []string{"mlx5_0:1", "mlx5_1:1"}, CUDA: true}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
	if r := ParseResources("#      resource 1  :  md 1  dev 1  flags -- tcp/lo\n"); len(r.RDMA) != 0 || r.CUDA {
		t.Fatalf("tcp alone is not RDMA: %+v", r)
	}
}

func TestResourcesOfThisMachine(t *testing.T) {
	l := loadUCX(t)
	c, err := l.NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := c.Resources()
	t.Logf("%+v", r)
	if len(r.Transports) == 0 {
		t.Fatal("UCX reports no transport at all")
	}
}

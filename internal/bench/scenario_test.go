package bench

import "testing"

// A bench's --device-a/-b list spreads a sim's ranks over its GPUs,
// whatever the shape; one device or cpu stays as given.
func TestPlaceRanksSpreadsAListOverTheRanks(t *testing.T) {
	for _, tc := range []struct {
		device string
		ranks  int
		want   string
	}{
		{"cpu", 2, "cpu"},
		{"cuda:1", 4, "cuda:1"},
		{"cuda:0,cuda:1", 2, "cuda:0,cuda:1"},
		{"cuda:0,cuda:1", 1, "cuda:0"},
		{"cuda:0, cuda:1", 4, "cuda:0,cuda:1,cuda:0,cuda:1"},
		{"cuda:0,cuda:1,cuda:2", 2, "cuda:0,cuda:1"},
	} {
		if got := placeRanks(tc.device, tc.ranks); got != tc.want {
			t.Errorf("placeRanks(%q, %d) = %q, want %q", tc.device, tc.ranks, got, tc.want)
		}
	}
}

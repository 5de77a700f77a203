package hooks

import (
	"encoding/json"
	"reflect"
	"testing"
)

func TestIntListRoundTrip(t *testing.T) {
	for _, in := range []IntList{nil, {}, {0}, {1, 2, 3, 4294967295, 151643}} {
		b, err := json.Marshal(in)
		if err != nil {
			t.Fatal(err)
		}
		var out IntList
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatal(err)
		}
		if len(in) != len(out) || (len(in) > 0 && !reflect.DeepEqual(in, out)) {
			t.Fatalf("%v → %s → %v", in, b, out)
		}
	}
	var out IntList
	if err := json.Unmarshal([]byte(`[5,6]`), &out); err != nil || !reflect.DeepEqual(out, IntList{5, 6}) {
		t.Fatalf("plain array: %v %v", out, err)
	}
	if err := json.Unmarshal([]byte(`"!!"`), &out); err == nil {
		t.Fatal("garbage accepted")
	}
	if _, err := json.Marshal(IntList{-1}); err == nil {
		t.Fatal("negative accepted")
	}
}

// FuzzIntList: whatever decodes is a list of uint32s that encodes back to
// the same list.
func FuzzIntList(f *testing.F) {
	for _, seed := range []string{`"AQAAAAIAAAA="`, `[1,2,3]`, `[-1]`, `"AQA="`, `""`, `[]`, `"\u0041"`, `[4294967296]`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var l IntList
		if err := json.Unmarshal(b, &l); err != nil {
			return
		}
		for _, x := range l {
			if x < 0 || x > 0xFFFFFFFF {
				t.Fatalf("%q decoded to %d", b, x)
			}
		}
		enc, err := json.Marshal(l)
		if err != nil {
			t.Fatalf("%v does not encode: %v", l, err)
		}
		var back IntList
		if err := json.Unmarshal(enc, &back); err != nil || len(back) != len(l) {
			t.Fatalf("round trip of %v: %v %v", l, back, err)
		}
		for i := range l {
			if back[i] != l[i] {
				t.Fatalf("round trip of %v: %v", l, back)
			}
		}
	})
}

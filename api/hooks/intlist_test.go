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

package hooks

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
)

// IntList is a list of non-negative 32-bit integers (token ids, offsets)
// that travels as base64 of little-endian uint32s: the final round exports
// and installs every moved request's prompt and output, and a JSON array of
// numbers costs several times more to encode and decode inside the pause.
// Unmarshal also accepts a plain JSON array.
type IntList []int

// MarshalText implements encoding.TextMarshaler: encoding/json writes the
// base64 as a plain string. (A json.Marshaler's output is re-scanned and
// compacted byte by byte, which cost ten times the encoding itself for a
// 256-request export.)
func (l IntList) MarshalText() ([]byte, error) {
	raw := make([]byte, 4*len(l))
	for i, v := range l {
		if v < 0 || v > 0xFFFFFFFF {
			return nil, fmt.Errorf("IntList: %d does not fit a uint32", v)
		}
		binary.LittleEndian.PutUint32(raw[4*i:], uint32(v))
	}
	return base64.StdEncoding.AppendEncode(make([]byte, 0, base64.StdEncoding.EncodedLen(len(raw))), raw), nil
}

// UnmarshalJSON implements json.Unmarshaler: base64 of little-endian
// uint32s, or a plain JSON array.
func (l *IntList) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '[' {
		var xs []int
		if err := json.Unmarshal(b, &xs); err != nil {
			return err
		}
		for _, x := range xs {
			if x < 0 || x > 0xFFFFFFFF {
				return fmt.Errorf("IntList: %d does not fit a uint32", x)
			}
		}
		*l = xs
		return nil
	}
	if len(b) < 2 || b[0] != '"' || b[len(b)-1] != '"' {
		return fmt.Errorf("IntList: want base64 or an array")
	}
	// base64 needs no JSON escapes: decode the bytes between the quotes
	// as they are (an escaped string is not base64 and fails here).
	raw, err := base64.StdEncoding.AppendDecode(make([]byte, 0, base64.StdEncoding.DecodedLen(len(b)-2)), b[1:len(b)-1])
	if err != nil || len(raw)%4 != 0 {
		return fmt.Errorf("IntList: bad base64 of uint32s")
	}
	out := make([]int, len(raw)/4)
	for i := range out {
		out[i] = int(binary.LittleEndian.Uint32(raw[4*i:]))
	}
	*l = out
	return nil
}

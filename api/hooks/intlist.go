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

// MarshalJSON implements json.Marshaler.
func (l IntList) MarshalJSON() ([]byte, error) {
	raw := make([]byte, 4*len(l))
	for i, v := range l {
		if v < 0 || v > 0xFFFFFFFF {
			return nil, fmt.Errorf("IntList: %d does not fit a uint32", v)
		}
		binary.LittleEndian.PutUint32(raw[4*i:], uint32(v))
	}
	out := make([]byte, 0, base64.StdEncoding.EncodedLen(len(raw))+2)
	out = append(out, '"')
	out = base64.StdEncoding.AppendEncode(out, raw)
	return append(out, '"'), nil
}

// UnmarshalJSON implements json.Unmarshaler.
func (l *IntList) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] == '[' {
		var xs []int
		if err := json.Unmarshal(b, &xs); err != nil {
			return err
		}
		*l = xs
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("IntList: want base64 or an array: %w", err)
	}
	raw, err := base64.StdEncoding.DecodeString(s)
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

// Package durations is how the Host's configuration file spells a
// duration. Its fields keep their names in seconds (ttl_s,
// request_timeout_s, …: the contract's) and take either a number of
// seconds (30, 0.5) or a duration as the Host's flags and the file's host
// section spell it (30s, 10m, 1h30m): one spelling works everywhere.
package durations

import (
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/invopop/jsonschema"
	"go.yaml.in/yaml/v3"
)

// Seconds is a duration in seconds, read from a number or a duration
// string.
type Seconds float64

// Duration is s as a time.Duration.
func (s Seconds) Duration() time.Duration { return time.Duration(float64(s) * float64(time.Second)) }

// Of is d in seconds.
func Of(d time.Duration) Seconds { return Seconds(d.Seconds()) }

// Parse reads a number of seconds or a duration string.
func Parse(v string) (Seconds, error) {
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		return Seconds(f), nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%q is neither a number of seconds nor a duration such as 30s or 10m", v)
	}
	return Of(d), nil
}

// UnmarshalYAML reads a scalar: a number, or a duration string.
func (s *Seconds) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return fmt.Errorf("line %d: want seconds (30) or a duration (30s, 10m)", n.Line)
	}
	v, err := Parse(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: %w", n.Line, err)
	}
	*s = v
	return nil
}

// UnmarshalJSON reads a number, or a duration string.
func (s *Seconds) UnmarshalJSON(b []byte) error {
	var str string
	if err := json.Unmarshal(b, &str); err == nil {
		v, err := Parse(str)
		if err != nil {
			return err
		}
		*s = v
		return nil
	}
	var f float64
	if err := json.Unmarshal(b, &f); err != nil {
		return fmt.Errorf("want seconds (30) or a duration (\"30s\"): %s", b)
	}
	*s = Seconds(f)
	return nil
}

// DurationPattern is what a duration string looks like (Go's
// time.ParseDuration, as the flags take it).
const DurationPattern = `^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$`

// JSONSchema is the configuration schema's type for Seconds: a number,
// or a string such as 10m.
func (Seconds) JSONSchema() *jsonschema.Schema {
	return &jsonschema.Schema{OneOf: []*jsonschema.Schema{
		{Type: "number", Minimum: json.Number("0")},
		{Type: "string", Pattern: DurationPattern},
	}}
}

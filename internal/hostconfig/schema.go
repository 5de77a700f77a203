package hostconfig

import (
	"encoding/json"

	"github.com/invopop/jsonschema"

	"github.com/vllm-hi/vllm-hi/internal/durations"
)

// Schema is the configuration file's JSON Schema, generated from File's
// Go types (their yaml names; unknown fields refused, as Parse refuses
// them): what an editor validates a vhi host --config file against.
// docs/host-config.schema.json is it, published; a test keeps it so.
func Schema(settings []Setting) ([]byte, error) {
	r := &jsonschema.Reflector{FieldNameTag: "yaml", RequiredFromJSONSchemaTags: true}
	s := r.Reflect(&File{})
	if def, ok := s.Definitions["File"]; ok {
		host := &jsonschema.Schema{Type: "object", Properties: jsonschema.NewProperties(), AdditionalProperties: jsonschema.FalseSchema,
			Description: "every other setting of vhi host, by its flag's name and in its syntax; a flag on the command line wins"}
		for _, st := range settings {
			host.Properties.Set(st.Name, st.schema())
		}
		def.Properties.Set("host", host)
	}
	s.ID = "https://github.com/vllm-hi/vllm-hi/docs/host-config.schema.json"
	s.Title = "vhi host --config"
	return json.MarshalIndent(s, "", "  ")
}

// Setting is one vhi host flag, as the file's host section takes it.
type Setting struct {
	Name, Type, Usage string
}

// schema is a setting's JSON Schema: its flag's type (durations as
// strings such as 10m).
func (st Setting) schema() *jsonschema.Schema {
	s := &jsonschema.Schema{Description: st.Usage}
	switch st.Type {
	case "bool":
		s.Type = "boolean"
	case "int", "int64", "uint", "uint64":
		s.Type = "integer"
	case "float64", "float32":
		s.Type = "number"
	case "duration":
		s.Type, s.Pattern = "string", durations.DurationPattern
	case "stringSlice", "stringArray":
		s.OneOf = []*jsonschema.Schema{{Type: "string"}, {Type: "array", Items: &jsonschema.Schema{Type: "string"}}}
	default:
		s.Type = "string"
	}
	return s
}

package hostconfig

import (
	"encoding/json"

	"github.com/invopop/jsonschema"
)

// Schema is the configuration file's JSON Schema, generated from File's
// Go types (their yaml names; unknown fields refused, as Parse refuses
// them): what an editor validates a vhi host --config file against.
// docs/host-config.schema.json is it, published; a test keeps it so.
func Schema() ([]byte, error) {
	r := &jsonschema.Reflector{FieldNameTag: "yaml", RequiredFromJSONSchemaTags: true}
	s := r.Reflect(&File{})
	s.ID = "https://github.com/vllm-hi/vllm-hi/docs/host-config.schema.json"
	s.Title = "vhi host --config"
	return json.MarshalIndent(s, "", "  ")
}

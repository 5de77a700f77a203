package hostconfig

import (
	"encoding/json"
	"flag"
	"os"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite docs/host-config.schema.json")

// The published schema is the one the Go types make (go test -update
// rewrites it), and it names the file's sections.
func TestPublishedSchemaIsCurrent(t *testing.T) {
	got, err := Schema()
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	const path = "../../docs/host-config.schema.json"
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil || string(want) != string(got) {
		t.Fatalf("%s is not what the Go types make (go test ./internal/hostconfig -update): %v", path, err)
	}
	var s map[string]any
	if err := json.Unmarshal(got, &s); err != nil {
		t.Fatal(err)
	}
	for _, section := range []string{`"targets"`, `"models"`, `"controller"`, `"autoscale"`} {
		if !strings.Contains(string(got), section) {
			t.Errorf("the schema lacks %s", section)
		}
	}
}

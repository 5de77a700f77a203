// Package hostconfig reads the Host's configuration file (vhi host
// --config FILE): YAML, every field known — a misspelt one is an error
// naming its line, not a setting silently ignored.
package hostconfig

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"go.yaml.in/yaml/v3"

	"github.com/vllm-hi/vllm-hi/internal/autoscale"
	"github.com/vllm-hi/vllm-hi/internal/launch"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// File is the configuration file.
type File struct {
	// Host holds every other setting of vhi host, by its flag's name and
	// in its flag's syntax (durations like 10m, 500ms): one file can
	// configure the whole Host; a flag given on the command line wins.
	Host map[string]any `yaml:"host"`
	// Targets are how to start a migration target on demand, by served
	// model name: a migrate request without dst_vllm_hi_id launches one
	// with the shape it asks for (target_tp, target_pp,
	// target_gpu_memory_utilization) and migrates to it.
	Targets map[string]launch.Spec `yaml:"targets"`
	// Models are the switched models by alias (docs/switching.md): long-
	// lived engines that share GPUs, woken and put to sleep as requests
	// for them come; Controller is the switching policy.
	Models     map[string]switching.Model `yaml:"models"`
	Controller switching.Controller       `yaml:"controller"`
	// Autoscale is the autoscaler's policies (docs/scaling.md); none: off.
	Autoscale autoscale.Config `yaml:"autoscale"`
}

// Load reads and checks the file at path.
func Load(path string) (File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return File{}, err
	}
	return Parse(b, path)
}

// Parse reads and checks a configuration; name is for messages.
func Parse(b []byte, name string) (File, error) {
	var f File
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil && !errors.Is(err, io.EOF) {
		return File{}, fmt.Errorf("%s: %w", name, err)
	}
	for model, s := range f.Targets {
		if err := s.Check(model); err != nil {
			return File{}, fmt.Errorf("%s: %w", name, err)
		}
	}
	if len(f.Models) > 0 || f.Controller != (switching.Controller{}) {
		if len(f.Models) == 0 {
			return File{}, fmt.Errorf("%s: a controller section without models", name)
		}
		if err := switching.Check(f.Models, f.Controller); err != nil {
			return File{}, fmt.Errorf("%s: %w", name, err)
		}
	}
	if err := f.Autoscale.Check(); err != nil {
		return File{}, fmt.Errorf("%s: %w", name, err)
	}
	return f, nil
}

package cli

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/vllm-hi/vllm-hi/internal/hostconfig"
)

// notInFile are the host flags a configuration file cannot set: those
// about the file itself, and what only makes sense on a command line.
var notInFile = []string{"config", "check", "config-schema", "help"}

// hostSettings are vhi host's flags as the file's host section takes
// them (hidden ones left out).
func hostSettings(cmd *cobra.Command) []hostconfig.Setting {
	var out []hostconfig.Setting
	visit := func(f *pflag.Flag) {
		if f.Hidden || slices.Contains(notInFile, f.Name) {
			return
		}
		out = append(out, hostconfig.Setting{Name: f.Name, Type: f.Value.Type(), Usage: f.Usage})
	}
	cmd.Flags().VisitAll(visit)
	cmd.InheritedFlags().VisitAll(visit)
	slices.SortFunc(out, func(a, b hostconfig.Setting) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// applyHostSection sets the flags the file's host section names, unless
// the command line gave them (it wins): the values bound to those flags
// change as if they had been given.
func applyHostSection(cmd *cobra.Command, section map[string]any) (applied, kept []string, err error) {
	for _, name := range slices.Sorted(maps.Keys(section)) {
		v := section[name]
		f := cmd.Flags().Lookup(name)
		if f == nil {
			f = cmd.InheritedFlags().Lookup(name)
		}
		if f == nil || f.Hidden || slices.Contains(notInFile, name) {
			return nil, nil, fmt.Errorf("host.%s: vhi host has no such setting (vhi host --help lists them)", name)
		}
		if f.Changed {
			kept = append(kept, name) // the command line wins
			continue
		}
		val := fmt.Sprint(v)
		if list, ok := v.([]any); ok {
			parts := make([]string, len(list))
			for i, x := range list {
				parts[i] = fmt.Sprint(x)
			}
			val = strings.Join(parts, ",")
		}
		if err := f.Value.Set(val); err != nil {
			return nil, nil, fmt.Errorf("host.%s: %v", name, err)
		}
		applied = append(applied, name+"="+f.Value.String())
	}
	return applied, kept, nil
}

package migrate

import (
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/vllm-hi/vllm-hi/api/hooks"
)

// Filter chooses which of the source's requests a migration moves.
type Filter interface {
	// Select returns the chosen requests, a subset of reqs.
	Select(reqs []hooks.RequestInfo) []hooks.RequestInfo
	String() string
}

// ParseFilter reads a filter spec:
//
//	all              every request (the default)
//	longest:N        the N requests with the most tokens
//	min_context:T    requests with at least T tokens (prompt + output)
//	ids:ID[,ID…]     exactly these request ids
func ParseFilter(spec string) (Filter, error) {
	spec = strings.TrimSpace(spec)
	name, arg, _ := strings.Cut(spec, ":")
	switch name {
	case "", "all":
		return allFilter{}, nil
	case "longest":
		n, err := strconv.Atoi(arg)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("filter %q: longest:N needs N ≥ 1", spec)
		}
		return longestFilter{n}, nil
	case "min_context":
		n, err := strconv.Atoi(arg)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("filter %q: min_context:T needs T ≥ 1", spec)
		}
		return minContextFilter{n}, nil
	case "ids":
		var ids []string
		for _, id := range strings.Split(arg, ",") {
			if id = strings.TrimSpace(id); id != "" {
				ids = append(ids, id)
			}
		}
		if len(ids) == 0 {
			return nil, fmt.Errorf("filter %q: ids: needs at least one id", spec)
		}
		return idsFilter(ids), nil
	}
	return nil, fmt.Errorf("unknown request filter %q (all, longest:N, min_context:T, ids:A,B)", spec)
}

type allFilter struct{}

func (allFilter) Select(r []hooks.RequestInfo) []hooks.RequestInfo { return r }
func (allFilter) String() string                                   { return "all" }

type longestFilter struct{ n int }

func (f longestFilter) Select(r []hooks.RequestInfo) []hooks.RequestInfo {
	out := append([]hooks.RequestInfo(nil), r...)
	sort.SliceStable(out, func(i, j int) bool { return tokens(out[i]) > tokens(out[j]) })
	return out[:min(f.n, len(out))]
}
func (f longestFilter) String() string { return fmt.Sprintf("longest:%d", f.n) }

type minContextFilter struct{ t int }

func (f minContextFilter) Select(r []hooks.RequestInfo) []hooks.RequestInfo {
	var out []hooks.RequestInfo
	for _, x := range r {
		if tokens(x) >= f.t {
			out = append(out, x)
		}
	}
	return out
}
func (f minContextFilter) String() string { return fmt.Sprintf("min_context:%d", f.t) }

type idsFilter []string

func (f idsFilter) Select(r []hooks.RequestInfo) []hooks.RequestInfo {
	want := map[string]bool{}
	for _, id := range f {
		want[id] = true
	}
	var out []hooks.RequestInfo
	for _, x := range r {
		if want[x.RequestID] {
			out = append(out, x)
		}
	}
	return out
}
func (f idsFilter) String() string { return "ids:" + strings.Join(f, ",") }

func tokens(r hooks.RequestInfo) int { return r.NumPromptTokens + r.NumOutputTokens }

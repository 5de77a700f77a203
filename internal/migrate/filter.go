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
	// Select returns the chosen requests, a subset of reqs. An error (an
	// expression that fails on some request) moves nothing.
	Select(reqs []Candidate) ([]Candidate, error)
	String() string
}

// Candidate is a request a migration could move: what the source engine
// says of it, and what the Host knows of its stream.
type Candidate struct {
	hooks.RequestInfo
	Model string // the served model the client asked for
	Tag   string // the client's X-Vhi-Tag header ("" when none)
	AgeS  float64
}

// ParseFilter reads a filter spec:
//
//	all              every request (the default)
//	longest:N        the N requests with the most tokens
//	min_context:T    requests with at least T tokens (prompt + output)
//	ids:ID[,ID…]     exactly these request ids
//	expr:EXPRESSION  the requests for which a CEL expression over their
//	                 fields is true (see exprFields), e.g.
//	                 expr:context_tokens > 2000 && tag == "batch"
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
	case "expr":
		return newExprFilter(arg)
	}
	return nil, fmt.Errorf("unknown request filter %q (all, longest:N, min_context:T, ids:A,B, expr:EXPRESSION)", spec)
}

type allFilter struct{}

func (allFilter) Select(r []Candidate) ([]Candidate, error) { return r, nil }
func (allFilter) String() string                            { return "all" }

type longestFilter struct{ n int }

func (f longestFilter) Select(r []Candidate) ([]Candidate, error) {
	out := append([]Candidate(nil), r...)
	sort.SliceStable(out, func(i, j int) bool { return tokens(out[i].RequestInfo) > tokens(out[j].RequestInfo) })
	return out[:min(f.n, len(out))], nil
}
func (f longestFilter) String() string { return fmt.Sprintf("longest:%d", f.n) }

type minContextFilter struct{ t int }

func (f minContextFilter) Select(r []Candidate) ([]Candidate, error) {
	var out []Candidate
	for _, x := range r {
		if tokens(x.RequestInfo) >= f.t {
			out = append(out, x)
		}
	}
	return out, nil
}
func (f minContextFilter) String() string { return fmt.Sprintf("min_context:%d", f.t) }

type idsFilter []string

func (f idsFilter) Select(r []Candidate) ([]Candidate, error) {
	want := map[string]bool{}
	for _, id := range f {
		want[id] = true
	}
	var out []Candidate
	for _, x := range r {
		if want[x.RequestID] {
			out = append(out, x)
		}
	}
	return out, nil
}
func (f idsFilter) String() string { return "ids:" + strings.Join(f, ",") }

func tokens(r hooks.RequestInfo) int { return r.NumPromptTokens + r.NumOutputTokens }

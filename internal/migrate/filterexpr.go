package migrate

import (
	"errors"
	"fmt"
	"strings"

	"cel.dev/cel-go/cel"
)

// exprFields are the variables a filter expression sees, one request at
// a time. Their names are part of the contract of expr: filters.
var exprFields = []struct {
	name string
	typ  *cel.Type
	doc  string
}{
	{"id", cel.StringType, "the engine's request id"},
	{"model", cel.StringType, "the served model the client asked for"},
	{"tag", cel.StringType, "the client's X-Vhi-Tag header, \"\" when none"},
	{"prompt_tokens", cel.IntType, "prompt length"},
	{"output_tokens", cel.IntType, "tokens generated so far"},
	{"context_tokens", cel.IntType, "prompt_tokens + output_tokens"},
	{"computed_tokens", cel.IntType, "tokens whose KV the source holds"},
	{"max_tokens", cel.IntType, "the request's max_tokens"},
	{"remaining_tokens", cel.IntType, "max_tokens - output_tokens"},
	{"blocks", cel.IntType, "KV blocks the request holds"},
	{"age_s", cel.DoubleType, "seconds since the request arrived"},
}

// exprCostLimit bounds one evaluation: a filter runs once per request in
// the migration's preparation, and a runaway expression (a large
// comprehension) must not hold it.
const exprCostLimit = 10_000

type exprFilter struct {
	src string
	prg cel.Program
}

// newExprFilter compiles a CEL expression that must be a bool. A compile
// error says where in the expression it is (line:column and a caret).
func newExprFilter(src string) (Filter, error) {
	src = strings.TrimSpace(src)
	if src == "" {
		return nil, errors.New("filter expr: needs an expression, e.g. expr:context_tokens > 1000")
	}
	var opts []cel.EnvOption
	for _, f := range exprFields {
		opts = append(opts, cel.Variable(f.name, f.typ))
	}
	env, err := cel.NewEnv(opts...)
	if err != nil {
		return nil, fmt.Errorf("filter expr: %w", err)
	}
	ast, iss := env.Compile(src)
	if iss.Err() != nil {
		return nil, fmt.Errorf("filter expr %q: %v (variables: %s)", src, iss.Err(), exprVariables())
	}
	if !ast.OutputType().IsExactType(cel.BoolType) {
		return nil, fmt.Errorf("filter expr %q: the expression is %s, want a bool", src, ast.OutputType())
	}
	prg, err := env.Program(ast, cel.CostLimit(exprCostLimit))
	if err != nil {
		return nil, fmt.Errorf("filter expr %q: %w", src, err)
	}
	return exprFilter{src: src, prg: prg}, nil
}

func exprVariables() string {
	var names []string
	for _, f := range exprFields {
		names = append(names, f.name)
	}
	return strings.Join(names, ", ")
}

func (f exprFilter) Select(reqs []Candidate) ([]Candidate, error) {
	var out []Candidate
	for _, r := range reqs {
		v, _, err := f.prg.Eval(map[string]any{
			"id": r.RequestID, "model": r.Model, "tag": r.Tag,
			"prompt_tokens": r.NumPromptTokens, "output_tokens": r.NumOutputTokens,
			"context_tokens": r.NumPromptTokens + r.NumOutputTokens, "computed_tokens": r.NumComputedTokens,
			"max_tokens": r.MaxTokens, "remaining_tokens": r.MaxTokens - r.NumOutputTokens,
			"blocks": len(r.BlockIDs), "age_s": r.AgeS,
		})
		if err != nil {
			return nil, fmt.Errorf("filter expr %q on request %s: %w", f.src, r.RequestID, err)
		}
		if b, ok := v.Value().(bool); ok && b {
			out = append(out, r)
		}
	}
	return out, nil
}

func (f exprFilter) String() string { return "expr:" + f.src }

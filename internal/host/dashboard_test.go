package host

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/prometheus/promql/parser"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/internal/registry"
	"github.com/vllm-hi/vllm-hi/internal/switching"
)

// recorder is a Registerer that keeps what it is given.
type recorder struct{ cs []prometheus.Collector }

func (r *recorder) Register(c prometheus.Collector) error   { r.cs = append(r.cs, c); return nil }
func (r *recorder) MustRegister(cs ...prometheus.Collector) { r.cs = append(r.cs, cs...) }
func (r *recorder) Unregister(prometheus.Collector) bool    { return false }

// exported are the names of every vhi_ metric the Host exports (with a
// histogram's _bucket, _sum and _count), whether or not it has a sample yet.
func exported(t *testing.T) map[string]bool {
	t.Helper()
	rec := &recorder{}
	newMetrics(rec, registry.New(registry.Options{Log: zap.NewNop()}))
	// Model switching's, registered when the Host switches models.
	rec.MustRegister(switching.NewMetrics().Collectors()...)
	fq := regexp.MustCompile(`fqName: "([^"]+)"`)
	names := map[string]bool{}
	for _, c := range rec.cs {
		ch := make(chan *prometheus.Desc, 16)
		go func() { c.Describe(ch); close(ch) }()
		for d := range ch {
			if m := fq.FindStringSubmatch(d.String()); m != nil {
				for _, suffix := range []string{"", "_bucket", "_sum", "_count"} {
					names[m[1]+suffix] = true
				}
			}
		}
	}
	return names
}

// Every query of the shipped Grafana dashboard parses as PromQL and reads
// only metrics the Host exports, and every vhi_ metric family is on it.
func TestGrafanaDashboard(t *testing.T) {
	raw, err := os.ReadFile("../../deploy/grafana/vllm-hi.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
		Annotations struct {
			List []struct {
				Name string `json:"name"`
				Expr string `json:"expr"`
			} `json:"list"`
		} `json:"annotations"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("the dashboard is not JSON: %v", err)
	}
	names := exported(t)
	used := map[string]bool{}
	p := parser.NewParser(parser.Options{})
	// Annotations are queries too (migrations marked on every panel).
	for _, a := range dash.Annotations.List {
		if a.Expr != "" {
			dash.Panels = append(dash.Panels, struct {
				Title   string `json:"title"`
				Type    string `json:"type"`
				Targets []struct {
					Expr string `json:"expr"`
				} `json:"targets"`
			}{Title: "annotation " + a.Name, Targets: []struct {
				Expr string `json:"expr"`
			}{{a.Expr}}})
		}
	}
	for _, panel := range dash.Panels {
		if panel.Type == "row" {
			continue // a heading
		}
		if len(panel.Targets) == 0 {
			t.Errorf("panel %q has no query", panel.Title)
		}
		for _, tg := range panel.Targets {
			expr, err := p.ParseExpr(tg.Expr)
			if err != nil {
				t.Errorf("panel %q: %q does not parse: %v", panel.Title, tg.Expr, err)
				continue
			}
			parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
				if vs, ok := n.(*parser.VectorSelector); ok {
					if !names[vs.Name] {
						t.Errorf("panel %q reads %s, which the Host does not export", panel.Title, vs.Name)
					}
					used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(vs.Name, "_bucket"), "_sum"), "_count")] = true
				}
				return nil
			})
		}
	}
	for n := range names {
		if strings.HasPrefix(n, "vhi_") && !strings.HasSuffix(n, "_bucket") && !strings.HasSuffix(n, "_sum") && !strings.HasSuffix(n, "_count") && !used[n] {
			t.Errorf("no panel shows %s", n)
		}
	}
}

// docs/operations.md's metrics table names every vhi_ metric the Host
// exports, and only those.
func TestMetricsTableInDocs(t *testing.T) {
	raw, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(raw)
	start := strings.Index(doc, "### Metrics (`GET /metrics`)")
	if start < 0 {
		t.Fatal("docs/operations.md has no metrics section")
	}
	section := doc[start:]
	if end := strings.Index(section[1:], "\n#"); end > 0 {
		section = section[:end+1]
	}
	row := regexp.MustCompile("(?m)^\\| `(vhi_[a-z0-9_]+)` \\|")
	listed := map[string]bool{}
	for _, m := range row.FindAllStringSubmatch(section, -1) {
		listed[m[1]] = true
	}
	names := exported(t)
	for n := range names {
		base := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")
		if strings.HasPrefix(n, "vhi_") && n == base && !listed[n] {
			t.Errorf("docs/operations.md's metrics table lacks %s", n)
		}
	}
	for n := range listed {
		if !names[n] {
			t.Errorf("docs/operations.md's metrics table lists %s, which the Host does not export", n)
		}
	}
}

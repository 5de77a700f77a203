package switching

import (
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/vllm-hi/vllm-hi/internal/tracing"
)

// traceSwitch records an ended switch as a span with a child per step
// (Options.Tracer), from its report: the steps timed as they ran.
func (s *Switcher) traceSwitch(rep *SwitchReport) {
	root := tracing.Span{Name: "switch", Start: rep.StartedAt, End: rep.StartedAt.Add(stepDuration(rep.DurationS)),
		Attributes: []attribute.KeyValue{attribute.String("vllm_hi.model", rep.Model), attribute.String("vllm_hi.from", rep.From),
			attribute.String("vllm_hi.state", rep.State), attribute.String("vllm_hi.drain", rep.Drain)}}
	for _, st := range rep.Steps {
		root.Children = append(root.Children, tracing.Span{Name: st.Step, Start: st.StartedAt, End: st.StartedAt.Add(stepDuration(st.DurationS)),
			Attributes: []attribute.KeyValue{attribute.String("vllm_hi.model", st.Model)}, Err: st.Error})
	}
	if rep.State != OutcomeSucceeded {
		root.Err = rep.Error
	}
	tracing.Record(s.tr, root)
}

func stepDuration(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

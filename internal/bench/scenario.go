package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"runtime/trace"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/host"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/loadgen"

	"github.com/vllm-hi/vllm-hi/internal/sim"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

// scenario is one "stream a load, migrate mid-stream, compare with an
// unmigrated run" experiment, shared by vhi demo and vhi bench migrate.
type scenario struct {
	Streams     int
	MaxTokens   int
	PromptWords int
	// SharedPrefixWords starts every prompt with the same system prompt
	// of this many words (a prefix cache holds it once).
	SharedPrefixWords int
	// DistinctPrefix puts the request's number before that system
	// prompt, so that no two prompts share a block: the same lengths
	// without sharing.
	DistinctPrefix   bool
	Sim              sim.Config
	DeviceA, DeviceB string // where each engine keeps its KV (sim --device); the reference uses DeviceA
	// ShapeA, ShapeB are the sims' TP×PP (zero: 1×1); the reference runs
	// 1×1 (a sim's tokens do not depend on its shape). A B of another
	// shape than A makes the migration a reshape.
	ShapeA, ShapeB   kvlayout.Parallel
	Delay            time.Duration // load start → migration
	Type             string
	FinalGranularity string
	PauseInFlight    string // the migration's pause_in_flight ("": the Host's)
	TN               int
	Verify           string  // the Host's --migration-verify ("" = its default)
	PreAttach        bool    // the Host's --migration-pre-attach
	PaceRound0       float64 // the sims' agents' --pace-round0 (0: off)
	TransferBackend  string  // the agents' --transfer-backend ("": auto)
	Log              *zap.Logger
	CPUProfile       string // write a CPU profile of the migration window here
	Trace            string // write an execution trace of the migration window here
	// Greedy makes every stream greedy (else every other one samples with
	// a seed): a real engine's sampled tokens follow its logits, which
	// change in the last bits with the batch a request runs in, unless the
	// engine is batch-invariant.
	Greedy bool
	// External runs against a running Host instead of starting sims.
	External *externalDeployment
	// HostStore and HostDataDir are the in-process Host's --store and
	// --data-dir (""/"": no durable state, as in-process stacks run).
	HostStore, HostDataDir string
	HostStorePrefix        string
	// Hosts is how many Hosts share HostStore (etcd): stream i goes
	// through Host i mod Hosts, the migration is asked of the first.
	Hosts int
}

// sizes are a sim shape's TP and PP, 1 where unset.
func sizes(p kvlayout.Parallel) (tp, pp int) { return max(p.TP, 1), max(p.PP, 1) }

// placeRanks is a sim's --device for ranks ranks from a bench's
// --device-a/-b: a list of GPUs spreads the ranks over them (rank i on
// the (i mod n)-th, as vLLM puts one worker per GPU), so one list serves
// every shape a bench runs; "cpu" or one GPU stays as it is.
func placeRanks(device string, ranks int) string {
	gpus := strings.Split(device, ",")
	if len(gpus) < 2 || len(gpus) == ranks {
		return device
	}
	out := make([]string, ranks)
	for i := range out {
		out[i] = strings.TrimSpace(gpus[i%len(gpus)])
	}
	return strings.Join(out, ",")
}

type scenarioResult struct {
	Status     hostapi.MigrationStatus
	Streams    []loadgen.Stream
	Reference  []loadgen.Stream // the same load without a migration
	Mismatches []string
	// Unjudged are streams that differed from their reference in a token
	// that reached the client before the source was paused: the source
	// made it on its own, reading nothing the migration wrote (a real
	// engine's numerics follow its batches and prefill chunks), so they
	// say nothing about the migration, either way.
	Unjudged []string
	// ByIDs counts the streams compared by token ids (both runs carried
	// every token's id), the rest by text.
	ByIDs int
	// ShortOfIDs says, for streams that carried token ids but not for
	// every token, how many and where the first event without them was:
	// a migration that lost the moved tokens' ids shows here.
	ShortOfIDs []string
	Wall       time.Duration
	MedianGap  time.Duration
	MaxGap     time.Duration
	MaxGapAt   time.Time // when the longest gap ended
	// MaxGapDuringMigration is the longest gap that ended while the
	// migration ran (or within a second after): what the migration cost
	// the clients, apart from prefill stalls before it.
	MaxGapDuringMigration time.Duration
	// MaxGapDuringMigrationByHost is the same for the streams of each
	// Host (scenario.Hosts > 1; stream i went through Host i mod Hosts).
	MaxGapDuringMigrationByHost []time.Duration
	// MigrationGapFrom and MigrationGapTo are when that gap began and
	// ended: which of the migration's steps it fell in says what caused it.
	MigrationGapFrom, MigrationGapTo time.Time
	MigrationStart                   time.Time
	StatsA                           string
	// Round0GapP99 is the 99th percentile of the clients' inter-token
	// gaps that ended during round 0 (the source decodes while its KV is
	// copied); BaselineGapP99 that of the gaps that ended in as long a
	// window (at least 500 ms) just before the migration, once every
	// stream had its first token (no prefill stalls): what round 0 costs
	// the source's clients (issue 35). Zero where a window has no gap.
	Round0GapP99, BaselineGapP99 time.Duration
	Round0Gaps, BaselineGaps     int
}

func (sc scenario) requests() []loadgen.Request {
	words := []string{"hello", "world", "model", "token", "stream", "water", "story", "house", "light", "earth"}
	reqs := make([]loadgen.Request, sc.Streams)
	for i := range reqs {
		prompt := ""
		if sc.DistinctPrefix {
			prompt = fmt.Sprintf("request %d: ", i)
		}
		for j := 0; j < sc.SharedPrefixWords; j++ {
			prompt += words[(j*3)%len(words)] + " "
		}
		prompt += fmt.Sprintf("request %d:", i)
		for j := 0; j < sc.PromptWords/2+(i*37)%(sc.PromptWords+1); j++ {
			prompt += " " + words[(i*7+j*3)%len(words)]
		}
		seed := int64(1000 + i)
		reqs[i] = loadgen.Request{Prompt: prompt, MaxTokens: sc.MaxTokens, IgnoreEOS: true, Seed: &seed}
		if i%2 == 0 && !sc.Greedy {
			reqs[i].Temperature = 0.8
		}
	}
	return reqs
}

// reference runs the load on a lone engine: the unmigrated truth.
func (sc scenario) reference(ctx context.Context, reqs []loadgen.Request) ([]loadgen.Stream, error) {
	c := sc.Sim
	c.Device = placeRanks(sc.DeviceA, max(c.TP, 1)*max(c.PP, 1))
	c.Model, c.ServedModelNames, c.ShmPrefix = "demo-model", nil, fmt.Sprintf("vhi-ref-%d", os.Getpid())
	ref, err := sim.Start(c, sc.Log)
	if err != nil {
		return nil, err
	}
	defer ref.Stop()
	return loadgen.Run(ctx, loadgen.Config{BaseURL: ref.URL, Model: "demo-model"}, reqs), nil
}

func (sc scenario) run(ctx context.Context) (scenarioResult, error) {
	if sc.External != nil {
		return sc.runExternal(ctx)
	}
	reqs := sc.requests()
	ref, err := sc.reference(ctx, reqs)
	if err != nil {
		return scenarioResult{}, fmt.Errorf("reference run: %w", err)
	}
	simA, simB := sc.Sim, sc.Sim
	simA.TP, simA.PP = sizes(sc.ShapeA)
	simB.TP, simB.PP = sizes(sc.ShapeB)
	simA.Device, simB.Device = placeRanks(sc.DeviceA, simA.TP*simA.PP), placeRanks(sc.DeviceB, simB.TP*simB.PP)
	tune := func(c *host.Config) {
		if sc.Verify != "" {
			c.Migration.Verify = sc.Verify
		}
		c.Migration.PreAttach = sc.PreAttach
		c.Store, c.DataDir = sc.HostStore, sc.HostDataDir
		if sc.HostStorePrefix != "" {
			c.StorePrefix = sc.HostStorePrefix
		}
	}
	st, err := stack.Start(stack.Options{Model: "demo-model", SimA: simA, SimB: simB, Log: sc.Log, TuneHost: tune, TransferBackend: sc.TransferBackend, PaceRound0: sc.PaceRound0,
		MoreHosts: max(0, sc.Hosts-1)})
	if err != nil {
		return scenarioResult{}, err
	}
	defer st.Stop()
	res, err := sc.migrateUnderLoad(ctx, st.Client(), st.HostURLs, "demo-model", st.AID, st.BID, reqs, ref)
	if err != nil {
		return res, err
	}
	sa, _ := st.A.Stats(ctx)
	sb, _ := st.B.Stats(ctx)
	res.StatsA = fmt.Sprintf("A: %d/%d blocks free, B: %d/%d blocks free", sa.FreeBlocks, sa.TotalBlocks, sb.FreeBlocks, sb.TotalBlocks)
	return res, nil
}

// externalDeployment is a running Host with its engines (real vLLM, or
// sims started by hand): vhi bench migrate --host.
type externalDeployment struct {
	Client   *hostapi.Client
	Model    string
	Src, Dst string
}

// runExternal runs the load through a running Host twice: once without a
// migration (the reference: the source serves it alone) and once with
// one. Engines that are not bitwise deterministic across batches (real
// vLLM without VLLM_BATCH_INVARIANT=1) differ between the two runs for
// reasons of their own; the report says how many streams differ either
// way.
func (sc scenario) runExternal(ctx context.Context) (scenarioResult, error) {
	x := sc.External
	reqs := sc.requests()
	for i := range reqs {
		// vLLM sends each event's token ids when asked: the streams are
		// compared by them, so a text slip (the detokenizer, the relay)
		// is told apart from a token the engine made otherwise.
		reqs[i].TokenIDs = true
	}
	ref := loadgen.Run(ctx, loadgen.Config{BaseURL: x.Client.Base(), Model: x.Model}, reqs)
	for i, s := range ref {
		if s.Err != nil {
			return scenarioResult{}, fmt.Errorf("reference run, stream %d: %w", i, s.Err)
		}
	}
	return sc.migrateUnderLoad(ctx, x.Client, []string{x.Client.Base()}, x.Model, x.Src, x.Dst, reqs, ref)
}

// migrateUnderLoad streams reqs through the Hosts at hostURLs (stream i
// through Host i mod their number), migrates src → dst after sc.Delay,
// and compares every stream with ref.
func (sc scenario) migrateUnderLoad(ctx context.Context, c *hostapi.Client, hostURLs []string, model, src, dst string, reqs []loadgen.Request, ref []loadgen.Stream) (scenarioResult, error) {
	var res scenarioResult
	done := make(chan []loadgen.Stream, 1)
	t0 := time.Now()
	go func() { done <- runSpread(ctx, hostURLs, model, reqs) }()
	select {
	case <-ctx.Done():
		return res, ctx.Err()
	case <-time.After(sc.Delay):
	}
	stopCapture, err := sc.captureWindow()
	if err != nil {
		return res, err
	}
	defer stopCapture()
	res.MigrationStart = time.Now()
	req := hostapi.MigrateRequest{Src: src, Dst: dst, Type: sc.Type, FinalGranularity: sc.FinalGranularity, PauseInFlight: sc.PauseInFlight, TN: sc.TN}
	if sc.ShapeB != (kvlayout.Parallel{}) && sc.External == nil { // a deployment's engines have their own shapes
		tp, pp := sizes(sc.ShapeB)
		req.TargetTP, req.TargetPP = &tp, &pp
	}
	id, err := c.Migrate(ctx, req)
	if err != nil {
		return res, fmt.Errorf("migrate: %w", err)
	}
	if res.Status, err = c.WaitMigration(ctx, id, 20*time.Millisecond, nil); err != nil {
		return res, err
	}
	stopCapture()
	res.Streams = <-done
	res.Wall = time.Since(t0)
	res.Reference = ref
	res.judge(ref, sc.External == nil, len(hostURLs))
	return res, nil
}

// divergence says where a stream first differs from its reference, and
// whether that token arrived before the source was paused. Until the
// pause the source decodes as it would without a migration (the rounds
// and checks only read its KV), so a stream that went its own way
// before it points at the engine's determinism (batching, chunked
// prefill), not at the migration. (Measured on one H100, 2026-12-06: a
// random-weight model's stream whose unmigrated runs on one engine
// parted at the same token two ways, ~0.3 s into round 0.)
func (res *scenarioResult) divergence(s, ref loadgen.Stream) (where string, before bool) {
	// By bytes, not token events: an engine may split the same text into
	// events differently from run to run.
	off := 0
	for off < len(s.Text) && off < len(ref.Text) && s.Text[off] == ref.Text[off] {
		off++
	}
	at := eventHolding(len(s.Pieces), off, func(i int) int { return len(s.Pieces[i]) })
	// A stream that is only shorter than its reference differs at its end:
	// never "before" (at is then past the last event).
	before, when := res.arrivedBefore(s, at)
	return fmt.Sprintf("from byte %d of %d (token event %d), %s: %q where the unmigrated run has %q", off, len(ref.Text), at, when,
		around(s.Text, off), around(ref.Text, off)), before
}

// eventHolding is the index of the event whose share (size) holds
// position off of all the events' shares in order; n where none does.
func eventHolding(n, off int, size func(i int) int) int {
	at, end := 0, 0
	for at < n {
		end += size(at)
		if end > off {
			break
		}
		at++
	}
	return at
}

// arrivedBefore reports whether s's event at reached the client before
// the source was paused, and says which in words.
func (res *scenarioResult) arrivedBefore(s loadgen.Stream, at int) (bool, string) {
	edge, what := res.sourcePausedAt()
	if at < len(s.Pieces) && at < len(s.Arrivals) && s.Arrivals[at].Before(edge) {
		return true, "before " + what
	}
	return false, "after " + what
}

// sourcePausedAt is when the Host asked the source to pause (the
// pause_source step's start), or the migration's start where the status
// has no such step (a migration that failed before it), and what it is.
func (res *scenarioResult) sourcePausedAt() (time.Time, string) {
	for _, st := range res.Status.StepHistory {
		if st.Step == "pause_source" && !st.StartedAt.IsZero() {
			return st.StartedAt, "the source was paused"
		}
	}
	return res.MigrationStart, "the migration began"
}

// byIDs reports whether s and ref can be compared by token ids: each
// carried an id for every token it counted.
func byIDs(s, ref loadgen.Stream) bool {
	whole := func(x loadgen.Stream) bool {
		return len(x.IDs) > 0 && x.Usage != nil && len(x.IDs) == x.Usage.CompletionTokens
	}
	return whole(s) && whole(ref)
}

// shortOfIDs says how a stream that carried some token ids lacks others
// ("" where it carried none, or all).
func shortOfIDs(s loadgen.Stream) string {
	if len(s.IDs) == 0 || s.Usage == nil || len(s.IDs) == s.Usage.CompletionTokens {
		return ""
	}
	first := slices.Index(s.PieceIDs, 0)
	return fmt.Sprintf("carried ids for %d of %d tokens (its first token event without them: %d of %d)",
		len(s.IDs), s.Usage.CompletionTokens, first, len(s.PieceIDs))
}

// idDivergence is divergence by token ids: where s's ids first differ
// from ref's, and whether the event carrying that token arrived before
// the source was paused.
func (res *scenarioResult) idDivergence(s, ref loadgen.Stream) (where string, before bool) {
	k := 0
	for k < len(s.IDs) && k < len(ref.IDs) && s.IDs[k] == ref.IDs[k] {
		k++
	}
	at := eventHolding(len(s.PieceIDs), k, func(i int) int { return s.PieceIDs[i] })
	before, when := res.arrivedBefore(s, at)
	near := func(ids []int) []int { return ids[max(0, k-3):min(len(ids), k+4)] }
	return fmt.Sprintf("from token %d of %d (token event %d), %s: ids %v where the unmigrated run has %v", k, len(ref.IDs), at, when,
		near(s.IDs), near(ref.IDs)), before
}

// around is the text near byte off, to show where two streams part.
func around(text string, off int) string {
	lo, hi := max(0, off-24), min(len(text), off+24)
	return text[lo:hi]
}

// judge compares the migrated run with the reference and measures the
// clients' inter-token gaps. sim: the engines are vhi sims, which send one
// event per token (vLLM may hold text back and send fewer) and are
// deterministic, so a stream that differs before the migration is a
// mismatch too.
func (res *scenarioResult) judge(ref []loadgen.Stream, sim bool, hosts int) {
	windowEnd := res.Status.FinishedAt.Add(time.Second)
	if hosts > 1 {
		res.MaxGapDuringMigrationByHost = make([]time.Duration, hosts)
	}
	var gaps []time.Duration
	for i, s := range res.Streams {
		switch {
		case s.Err != nil:
			res.Mismatches = append(res.Mismatches, fmt.Sprintf("stream %d failed: %v", i, s.Err))
		case ref[i].Err != nil:
			res.Mismatches = append(res.Mismatches, fmt.Sprintf("reference %d failed: %v", i, ref[i].Err))
		case byIDs(s, ref[i]) && !slices.Equal(s.IDs, ref[i].IDs):
			res.ByIDs++
			where, before := res.idDivergence(s, ref[i])
			msg := fmt.Sprintf("stream %d differs from its unmigrated run %s", i, where)
			if before && !sim {
				res.Unjudged = append(res.Unjudged, msg)
			} else {
				res.Mismatches = append(res.Mismatches, msg)
			}
		case s.Text != ref[i].Text:
			where, before := res.divergence(s, ref[i])
			msg := fmt.Sprintf("stream %d differs from its unmigrated run %s", i, where)
			switch {
			case byIDs(s, ref[i]):
				// The same tokens, other text: never the engine's doing.
				res.ByIDs++
				res.Mismatches = append(res.Mismatches, fmt.Sprintf("stream %d has its unmigrated run's token ids but not its text, %s", i, where))
			case before && !sim:
				res.Unjudged = append(res.Unjudged, msg)
			default:
				res.Mismatches = append(res.Mismatches, msg)
			}
		case s.Done != 1 || s.Usage == nil || ref[i].Usage == nil || *s.Usage != *ref[i].Usage:
			res.Mismatches = append(res.Mismatches, fmt.Sprintf("stream %d: %d [DONE], usage %+v, unmigrated %+v", i, s.Done, s.Usage, ref[i].Usage))
		case sim && s.Usage.CompletionTokens != len(s.Pieces):
			res.Mismatches = append(res.Mismatches, fmt.Sprintf("stream %d: %d token events, usage %+v", i, len(s.Pieces), s.Usage))
		case byIDs(s, ref[i]):
			res.ByIDs++
		default:
			if why := shortOfIDs(s); why != "" {
				res.ShortOfIDs = append(res.ShortOfIDs, fmt.Sprintf("stream %d %s", i, why))
			}
		}
		for j := 1; j < len(s.Arrivals); j++ {
			g := s.Arrivals[j].Sub(s.Arrivals[j-1])
			gaps = append(gaps, g)
			if g > res.MaxGap {
				res.MaxGap, res.MaxGapAt = g, s.Arrivals[j]
			}
			during := s.Arrivals[j].After(res.MigrationStart) && s.Arrivals[j].Before(windowEnd)
			if during && g > res.MaxGapDuringMigration {
				res.MaxGapDuringMigration, res.MigrationGapFrom, res.MigrationGapTo = g, s.Arrivals[j-1], s.Arrivals[j]
			}
			if during && hosts > 1 {
				res.MaxGapDuringMigrationByHost[i%hosts] = max(res.MaxGapDuringMigrationByHost[i%hosts], g)
			}
		}
	}
	res.MedianGap = loadgen.Percentile(gaps, 0.5)
	res.round0Gaps()
}

// round0Gaps measures Round0GapP99 and BaselineGapP99.
func (res *scenarioResult) round0Gaps() {
	var r0From, r0To time.Time
	for _, st := range res.Status.StepHistory {
		if st.Step == "round_0" {
			r0From, r0To = st.StartedAt, st.EndedAt
		}
	}
	if r0From.IsZero() || r0To.IsZero() {
		return
	}
	var steady time.Time // every stream had its first token
	for _, s := range res.Streams {
		if len(s.Arrivals) > 0 && s.Arrivals[0].After(steady) {
			steady = s.Arrivals[0]
		}
	}
	baseFrom := res.MigrationStart.Add(-max(r0To.Sub(r0From), 500*time.Millisecond))
	if baseFrom.Before(steady) {
		baseFrom = steady
	}
	var during, before []time.Duration
	for _, s := range res.Streams {
		for j := 1; j < len(s.Arrivals); j++ {
			g, at := s.Arrivals[j].Sub(s.Arrivals[j-1]), s.Arrivals[j]
			switch {
			case !at.Before(r0From) && !at.After(r0To):
				during = append(during, g)
			case !at.Before(baseFrom) && at.Before(res.MigrationStart) && !s.Arrivals[j-1].Before(steady):
				before = append(before, g)
			}
		}
	}
	res.Round0Gaps, res.BaselineGaps = len(during), len(before)
	if len(during) > 0 {
		res.Round0GapP99 = loadgen.Percentile(during, 0.99)
	}
	if len(before) > 0 {
		res.BaselineGapP99 = loadgen.Percentile(before, 0.99)
	}
}

// captureWindow starts the CPU profile and the execution trace the
// scenario asks for; the returned function stops them and may be called
// more than once.
func (sc scenario) captureWindow() (stop func(), err error) {
	var stops []func()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			for i := len(stops) - 1; i >= 0; i-- {
				stops[i]()
			}
		})
	}
	for _, c := range []struct {
		path  string
		start func(io.Writer) error
		stop  func()
	}{
		{sc.CPUProfile, pprof.StartCPUProfile, pprof.StopCPUProfile},
		{sc.Trace, trace.Start, trace.Stop},
	} {
		if c.path == "" {
			continue
		}
		f, err := os.Create(c.path)
		if err != nil {
			stop()
			return nil, err
		}
		if err := c.start(f); err != nil {
			f.Close()
			stop()
			return nil, err
		}
		stops = append(stops, func() { c.stop(); f.Close() })
	}
	return stop, nil
}

// runSpread runs reqs through the Hosts at urls, request i through Host
// i mod len(urls), all at once, and returns the streams in reqs' order.
func runSpread(ctx context.Context, urls []string, model string, reqs []loadgen.Request) []loadgen.Stream {
	if len(urls) == 1 {
		return loadgen.Run(ctx, loadgen.Config{BaseURL: urls[0], Model: model}, reqs)
	}
	out := make([]loadgen.Stream, len(reqs))
	var wg sync.WaitGroup
	for h, u := range urls {
		var part []loadgen.Request
		for i := h; i < len(reqs); i += len(urls) {
			part = append(part, reqs[i])
		}
		wg.Go(func() {
			for k, s := range loadgen.Run(ctx, loadgen.Config{BaseURL: u, Model: model}, part) {
				i := h + k*len(urls)
				s.Index = i
				out[i] = s
			}
		})
	}
	wg.Wait()
	return out
}

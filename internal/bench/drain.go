package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"go.uber.org/zap"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
	"github.com/vllm-hi/vllm-hi/internal/stack"
)

func newBenchDrainCommand(g *Options) *cobra.Command {
	var o opsBench
	cmd := &cobra.Command{
		Use:   "drain",
		Short: "Drain by migration of a loaded instance against one migration of the same load, and against waiting",
		Long: `Starts a Host with two active sims of one model in this process; --streams streams run on
A (B idle). After --delay, run 1 moves every request A→B by one keep_source_active migration;
run 2, on a fresh deployment with the same load, drains A (vhi drain). Reports each one's
time, the clients' max inter-token gap while it ran, and what a drain by waiting would have
taken (A's last stream's end in the unmigrated reference run); every stream is checked
against the reference. The goal (docs/operations.md): the drain within two migrations' time,
no stream failed or inexact.`,
		Args: cobra.NoArgs,
		RunE: g.runLogged(func(cmd *cobra.Command, log *zap.Logger) error {
			o.log = log
			return runBenchDrain(cmd.Context(), cmd.OutOrStdout(), o)
		}),
	}
	o.register(cmd.Flags(), 256, 400, 3*time.Second)
	return cmd
}

func runBenchDrain(ctx context.Context, out io.Writer, o opsBench) error {
	if o.log == nil {
		o.log = zap.NewNop()
	}
	header(out, "drain", o, "; every stream on A, B active and idle")
	reqs := o.requests()
	ref, err := o.reference(ctx, reqs)
	if err != nil {
		return err
	}
	// What a drain that waits for the streams instead would take: from the
	// moment the drain begins to the end of the last stream, unmigrated.
	waited := lastArrival(ref).Sub(firstStart(ref).Add(o.delay))

	type result struct {
		took, maxGap time.Duration
		check        streamCheck
		line         string
	}
	run := func(op func(context.Context, *stack.Stack) (time.Time, string, error)) (result, error) {
		var r result
		st, err := o.start(nil)
		if err != nil {
			return r, err
		}
		defer st.Stop()
		done, t0, err := loadOnA(ctx, st, reqs)
		if err != nil {
			return r, err
		}
		if err := wait(ctx, time.Until(t0.Add(o.delay))); err != nil {
			return r, err
		}
		begin := time.Now()
		end, line, err := op(ctx, st)
		if err != nil {
			<-done
			return r, err
		}
		streams := <-done
		r.took, r.line = end.Sub(begin), line
		r.maxGap = maxGapBetween(streams, begin, end.Add(time.Second))
		r.check = checkStreams(streams, ref)
		return r, nil
	}
	mig, err := run(func(ctx context.Context, s *stack.Stack) (time.Time, string, error) {
		id, err := s.Client().Migrate(ctx, hostapi.MigrateRequest{Src: s.AID, Dst: s.BID, Type: hostapi.KeepSourceActive})
		if err != nil {
			return time.Time{}, "", fmt.Errorf("migrate: %w", err)
		}
		st, err := s.Client().WaitMigration(ctx, id, 10*time.Millisecond, nil)
		if err != nil {
			return time.Time{}, "", err
		}
		if st.State != hostapi.StateSucceeded {
			return time.Time{}, "", fmt.Errorf("the migration %s: %s", st.State, st.Error)
		}
		return time.Now(), fmt.Sprintf("%d/%d requests, downtime %.3f s", st.Migrated, st.Requests, st.DowntimeS), nil
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "one migration of every request A→B: %.3f s (%s); clients' max gap meanwhile %s; streams: %s\n",
		mig.took.Seconds(), mig.line, msText(mig.maxGap), mig.check)
	dr, err := run(func(ctx context.Context, s *stack.Stack) (time.Time, string, error) {
		id, err := s.Client().Drain(ctx, s.AID, hostapi.DrainRequest{})
		if err != nil {
			return time.Time{}, "", fmt.Errorf("drain: %w", err)
		}
		st, err := s.Client().WaitDrain(ctx, id, 10*time.Millisecond, nil)
		if err != nil {
			return time.Time{}, "", err
		}
		if st.State != hostapi.StateSucceeded {
			return time.Time{}, "", fmt.Errorf("the drain %s: %s", st.State, st.Error)
		}
		in, err := s.Client().Instance(ctx, s.AID)
		if err != nil {
			return time.Time{}, "", err
		}
		var migrating time.Duration
		for _, mid := range st.Migration {
			m, err := s.Client().Migration(ctx, mid)
			if err != nil {
				return time.Time{}, "", err
			}
			migrating += m.FinishedAt.Sub(m.CreatedAt)
		}
		return time.Now(), fmt.Sprintf("%d migration(s) taking %.3f s, %d moved, %d finished there, A %s", len(st.Migration), migrating.Seconds(), st.Moved, st.Finished, in.Lifecycle), nil
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "drain of A: %.3f s (%s); clients' max gap meanwhile %s; streams: %s\n",
		dr.took.Seconds(), dr.line, msText(dr.maxGap), dr.check)
	fmt.Fprintf(out, "drain ÷ one migration: %.2f (goal ≤ 2); a drain by waiting for A's streams to end: %.1f s (%.0f× the drain)\n",
		dr.took.Seconds()/mig.took.Seconds(), waited.Seconds(), waited.Seconds()/dr.took.Seconds())
	if err := mig.check.err("the migration's streams"); err != nil {
		return err
	}
	return dr.check.err("the drain's streams")
}

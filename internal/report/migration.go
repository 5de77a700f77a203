// Package report prints the Host's statuses for people: the summaries
// that `vhi migration status`, `vhi migrate --wait` and the benchmarks
// show.
package report

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/vllm-hi/vllm-hi/api/hostapi"
)

// Bytes is n bytes in binary units, as the reports print sizes.
func Bytes(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}

// Migration prints the summary of a migration: its table row, rounds,
// check, source KV and pause.
func Migration(out io.Writer, st hostapi.MigrationStatus) {
	var blocks int
	var bytes int64
	for _, r := range st.Rounds {
		blocks += r.BlockCount
		bytes += r.Bytes
	}
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "migration\tstate\tsource\ttarget\ttype\trequests\tdowntime (s)\tclient downtime (s)\trounds\tKV blocks\tdata size (GB)")
	fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d/%d\t%.4f\t%.4f\t%d\t%d\t%.3f\n", st.ID, st.State, st.Src, st.Dst, st.Type,
		st.Migrated, st.Requests, st.DowntimeS, st.ClientDowntimeS, len(st.Rounds), blocks, float64(bytes)/1e9)
	_ = tw.Flush()
	var parts []string
	for _, r := range st.Rounds {
		parts = append(parts, fmt.Sprintf("%s %d / %s", r.Kind, r.BlockCount, Bytes(r.Bytes)))
	}
	if len(parts) > 0 {
		fmt.Fprintf(out, "rounds (blocks / bytes): %s\n", strings.Join(parts, " | "))
		for _, r := range st.Rounds {
			switch {
			case r.SharedBytesSaved > 0:
				fmt.Fprintf(out, "shared prefixes: %d copies of source blocks that several moving requests hold were left out of round %d (the target shares them too): %s not sent, %.1f %% of a copy per request\n",
					r.SharedBlocks, r.Round, Bytes(r.SharedBytesSaved), 100*float64(r.SharedBytesSaved)/float64(r.Bytes+r.SharedBytesSaved))
			case r.SharedBlocks > 0 && r.BlockCount > 0:
				fmt.Fprintf(out, "shared prefixes: %d of round %d's %d block copies are of a source block another moving request holds too (the target keeps a copy per request: %.1f %% of its bytes sent more than once)\n",
					r.SharedBlocks, r.Round, r.BlockCount, 100*float64(r.SharedBlocks)/float64(r.BlockCount))
			}
			if r.SourceGapP99S > 0 && r.SourceGapP99BeforeS > 0 {
				fmt.Fprintf(out, "round %d and the moving streams as the Host read them from the source: inter-token gap p99 %.1f ms while it copied, %.1f ms in the second before (×%.2f)\n",
					r.Round, 1000*r.SourceGapP99S, 1000*r.SourceGapP99BeforeS, r.SourceGapP99S/r.SourceGapP99BeforeS)
			}
			if r.PacedChunks > 0 {
				fmt.Fprintf(out, "round %d paced by the source's steps: %d chunks; the source's step %.1f ms before it, %.1f ms at the slowest chunk\n",
					r.Round, r.PacedChunks, 1000*r.SourceStepBeforeS, 1000*r.SourceStepSlowestS)
			}
		}
		if n := len(st.Recomputed); n > 0 {
			fmt.Fprintf(out, "moved as state only (the target had no room for their KV and recomputes it): %d of %d requests\n", n, st.Migrated)
		}
		if st.TransferBackend != "" {
			fmt.Fprintf(out, "data plane: %s (%s)\n", st.TransferBackend, st.TransferBackendReason)
		}
	}
	if v := st.Verification; v != nil && v.Mode != hostapi.VerifyOff {
		fmt.Fprintf(out, "checked before the commit (%s): %d blocks, %s on each side, %.1f ms\n", v.Mode, v.Blocks, Bytes(v.Bytes), v.DurationS*1000)
	}
	if st.SourceKV != "" && st.SourceKV != hostapi.SourceKVKept {
		note := ""
		if st.SourceKVNote != "" {
			note = " (" + st.SourceKVNote + ")"
		}
		fmt.Fprintf(out, "source KV: %s%s\n", strings.ReplaceAll(st.SourceKV, "_", " "), note)
	}
	if st.PauseWaitS > 0 {
		fmt.Fprintf(out, "the pause first waited %.1f ms for the source's step in flight (not downtime: the source decoded meanwhile)\n", st.PauseWaitS*1000)
	}
	if st.Error != "" {
		fmt.Fprintf(out, "error: %s\n", st.Error)
	}
}

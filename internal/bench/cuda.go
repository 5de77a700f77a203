package bench

import (
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/vllm-hi/vllm-hi/internal/cuda"
	"github.com/vllm-hi/vllm-hi/internal/kvlayout"
	"github.com/vllm-hi/vllm-hi/internal/transfer/cudaipc"
)

func newBenchCUDACopyCommand() *cobra.Command {
	var (
		srcDev, dstDev, blocks, reps int
		sizes                        string
	)
	cmd := &cobra.Command{
		Use:   "cuda-copy",
		Short: "Data-plane microbenchmark: scattered KV blocks GPU→GPU against one large copy",
		Long: `Allocates --blocks blocks of each --block-bytes size on --src-device and
--dst-device, then copies every block to a random (so never mergeable)
target block through the cuda_ipc copier: in batches (cuMemcpyBatchAsync)
and one cuMemcpyAsync per block, and compares both with one large copy of
the same bytes. Each figure is the median of --reps; sampled blocks are
checked byte for byte after the copy. A last row reads the source's blocks,
in a random order, with the integrity check's hash kernel (vhi_kvsum; block
sizes of whole 512-byte K/V pairs). Needs two GPUs of one node (or one:
--dst-device equal to --src-device).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var bs []uint64
			for _, s := range strings.Split(sizes, ",") {
				n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 64)
				if err != nil || n == 0 {
					return fmt.Errorf("--block-bytes: %q is not a positive byte count", s)
				}
				bs = append(bs, n)
			}
			if blocks < 1 || reps < 1 {
				return fmt.Errorf("--blocks and --reps must be positive")
			}
			drv, err := cuda.Load()
			if err != nil {
				return err
			}
			defer drv.Close()
			return runBenchCUDACopy(cmd.OutOrStdout(), drv, srcDev, dstDev, blocks, reps, bs)
		},
	}
	cmd.Flags().IntVar(&srcDev, "src-device", 0, "source GPU")
	cmd.Flags().IntVar(&dstDev, "dst-device", 1, "target GPU")
	cmd.Flags().IntVar(&blocks, "blocks", 10000, "blocks per size")
	cmd.Flags().IntVar(&reps, "reps", 5, "timed repetitions (median reported)")
	cmd.Flags().StringVar(&sizes, "block-bytes", "2359296,65536", "block sizes in bytes, comma-separated (2.36 MB is a Qwen3-8B block)")
	return cmd
}

func runBenchCUDACopy(w io.Writer, drv *cuda.Lib, srcDev, dstDev, blocks, reps int, sizes []uint64) error {
	n, err := drv.DeviceCount()
	if err != nil {
		return err
	}
	if srcDev >= n || dstDev >= n {
		return fmt.Errorf("devices %d and %d asked for; %d visible", srcDev, dstDev, n)
	}
	// Same-node engines are mapped through IPC with peer access enabled;
	// here both sides are this process's, so enable it directly.
	if err := drv.EnablePeer(srcDev, dstDev); err != nil {
		return fmt.Errorf("peer access GPU%d→GPU%d: %w", srcDev, dstDev, err)
	}
	name, _ := drv.DeviceName(srcDev)
	fmt.Fprintf(w, "GPU%d→GPU%d (%s), %d blocks per size, median of %d; cuMemcpyBatchAsync available: %v\n",
		srcDev, dstDev, name, blocks, reps, drv.HasBatchCopy())
	fmt.Fprintf(w, "%-12s %-28s %10s %10s %9s\n", "block", "method", "time", "GB/s", "vs large")
	for _, bsz := range sizes {
		total := bsz * uint64(blocks)
		src, err := drv.Alloc(srcDev, total)
		if err != nil {
			return fmt.Errorf("allocate %d bytes on GPU%d: %w", total, srcDev, err)
		}
		dst, err := drv.Alloc(dstDev, total)
		if err != nil {
			_ = drv.Free(srcDev, src)
			return fmt.Errorf("allocate %d bytes on GPU%d: %w", total, dstDev, err)
		}
		err = benchOneSize(w, drv, srcDev, dstDev, src, dst, bsz, blocks, reps)
		_ = drv.Free(srcDev, src)
		_ = drv.Free(dstDev, dst)
		if err != nil {
			return err
		}
	}
	return nil
}

func benchOneSize(w io.Writer, drv *cuda.Lib, srcDev, dstDev int, src, dst cuda.DevicePtr, bsz uint64, blocks, reps int) error {
	// Fill the source with a per-block pattern (1 MiB staged at a time).
	chunk := make([]byte, min(bsz*uint64(blocks), 1<<20))
	for off := uint64(0); off < bsz*uint64(blocks); off += uint64(len(chunk)) {
		n := min(uint64(len(chunk)), bsz*uint64(blocks)-off)
		for i := range chunk[:n] {
			chunk[i] = byte((off + uint64(i)) / bsz * 7)
			if (off+uint64(i))%251 == 0 {
				chunk[i] ^= 0x5A
			}
		}
		if err := drv.HtoD(srcDev, src+cuda.DevicePtr(off), chunk[:n]); err != nil {
			return err
		}
	}
	stream, err := drv.NewStream(srcDev)
	if err != nil {
		return err
	}
	defer drv.DestroyStream(srcDev, stream)
	// Each method gets its own permutation, so a check after it proves
	// that method moved the blocks.
	scatter := func(seed uint64) ([]int, []kvlayout.CopyRun) {
		perm := rand.New(rand.NewPCG(seed, 2)).Perm(blocks)
		runs := make([]kvlayout.CopyRun, blocks)
		for i, j := range perm {
			runs[i] = kvlayout.CopyRun{SrcOffset: int64(uint64(i) * bsz), DstOffset: int64(uint64(j) * bsz), Length: int64(bsz)}
		}
		return perm, runs
	}
	large := []kvlayout.CopyRun{{Length: int64(bsz * uint64(blocks))}}
	copier := &cudaipc.Copier{Driver: drv, Device: srcDev, Stream: stream}
	timeIt := func(runs []kvlayout.CopyRun, method string, loop bool) (time.Duration, error) {
		drv.ForceLoop = loop
		copier.Method = method
		defer func() { drv.ForceLoop = false }()
		var ds []time.Duration
		for r := 0; r < reps+1; r++ { // the first is a warm-up
			start := time.Now()
			if err := copier.Run(cudaipc.Regions{src}, cudaipc.Regions{dst}, runs); err != nil {
				return 0, err
			}
			if r > 0 {
				ds = append(ds, time.Since(start))
			}
		}
		sort.Slice(ds, func(a, b int) bool { return ds[a] < ds[b] })
		return ds[len(ds)/2], nil
	}
	bytes := float64(bsz) * float64(blocks)
	base, err := timeIt(large, cudaipc.MethodBatch, false)
	if err != nil {
		return err
	}
	label := fmt.Sprintf("%d B", bsz)
	fmt.Fprintf(w, "%-12s %-28s %10s %10.1f %8.0f%%\n", label, "one large copy", base.Round(time.Microsecond), bytes/base.Seconds()/1e9, 100.0)
	methods := []struct {
		name, method, kernel string
		loop                 bool
	}{
		{"one large copy, kernel", cudaipc.MethodKernel, cuda.KernelPerCTA, false},
		{"scattered, kernel per CTA", cudaipc.MethodKernel, cuda.KernelPerCTA, false},
		{"scattered, kernel per warp", cudaipc.MethodKernel, cuda.KernelPerWarp, false},
		{"scattered, batched (CE)", cudaipc.MethodBatch, "", false},
		{"scattered, one call each", cudaipc.MethodBatch, "", true},
	}
	defer func(k string) { drv.CopyKernel = k }(drv.CopyKernel)
	for k, m := range methods {
		if !m.loop && m.method == cudaipc.MethodBatch && !drv.HasBatchCopy() {
			continue
		}
		perm, runs := scatter(uint64(k + 1))
		if k == 0 {
			perm, runs = nil, large
		}
		if m.kernel != "" {
			drv.CopyKernel = m.kernel
		}
		d, err := timeIt(runs, m.method, m.loop)
		if err != nil {
			return fmt.Errorf("%s: %w", m.name, err)
		}
		fmt.Fprintf(w, "%-12s %-28s %10s %10.1f %8.0f%%\n", label, m.name, d.Round(time.Microsecond), bytes/d.Seconds()/1e9, 100*base.Seconds()/d.Seconds())
		if perm != nil {
			if err := checkBlocks(drv, srcDev, dstDev, src, dst, bsz, perm); err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
		}
		if m.kernel != "" && perm != nil {
			// The same copies with their descriptors written in chunks
			// where each launch reads them (VLLM_HI_COPY_DESCRIPTORS=chunks),
			// side by side with the list built first above.
			// A permutation of its own: the check proves these copies.
			perm, runs := scatter(uint64(k + 101))
			was := drv.ChunkedDescriptors
			drv.ChunkedDescriptors = !was
			d, err := timeIt(runs, m.method, m.loop)
			drv.ChunkedDescriptors = was
			if err != nil {
				return fmt.Errorf("%s, descriptors %s: %w", m.name, descriptorsName(!was), err)
			}
			fmt.Fprintf(w, "%-12s %-28s %10s %10.1f %8.0f%%\n", label, "  descriptors "+descriptorsName(!was), d.Round(time.Microsecond), bytes/d.Seconds()/1e9, 100*base.Seconds()/d.Seconds())
			if err := checkBlocks(drv, srcDev, dstDev, src, dst, bsz, perm); err != nil {
				return fmt.Errorf("%s, descriptors %s: %w", m.name, descriptorsName(!was), err)
			}
		}
		if m.kernel != "" {
			// The same launch with the GPU's own times: the host's part
			// of the call above is what they leave out.
			if err := gpuTimes(w, drv, srcDev, stream, src, dst, runs, reps, bytes, base, label, m.name); err != nil {
				return fmt.Errorf("%s: %w", m.name, err)
			}
		}
	}
	return benchKVSum(w, drv, srcDev, stream, src, bsz, blocks, reps, base, label)
}

// descriptorsName is how VLLM_HI_COPY_DESCRIPTORS names a Lib's choice.
func descriptorsName(chunked bool) string {
	if chunked {
		return "in chunks"
	}
	return "as one list"
}

// gpuTimes launches runs' copies with KernelCopyTimed and prints the
// GPU's median times for the descriptors' upload and for the kernel.
func gpuTimes(w io.Writer, drv *cuda.Lib, dev int, stream cuda.Stream, src, dst cuda.DevicePtr, runs []kvlayout.CopyRun, reps int,
	bytes float64, base time.Duration, label, name string) error {
	copies, err := cudaipc.KernelCopies(cudaipc.Regions{src}, cudaipc.Regions{dst}, runs)
	if err != nil {
		return err
	}
	var ups, ks []time.Duration
	for r := 0; r < reps+1; r++ { // the first is a warm-up
		up, k, err := drv.KernelCopyTimed(dev, stream, copies)
		if err != nil {
			return err
		}
		if r > 0 {
			ups, ks = append(ups, up), append(ks, k)
		}
	}
	med := func(ds []time.Duration) time.Duration {
		sort.Slice(ds, func(a, b int) bool { return ds[a] < ds[b] })
		return ds[len(ds)/2]
	}
	k := med(ks)
	fmt.Fprintf(w, "%-12s %-28s %10s %10.1f %8.0f%%  (GPU: kernel alone, %d descriptors; their upload %s)\n", label, "  "+name, k.Round(time.Microsecond),
		bytes/k.Seconds()/1e9, 100*base.Seconds()/k.Seconds(), len(copies), med(ups).Round(time.Microsecond))
	return nil
}

// benchKVSum times the integrity check's hash kernel (vhi_kvsum) over the
// source's blocks taken in a random order: each block one task of K and V
// halves of 256-byte head slots (what a block of one layer and one KV head
// is; the check's real tasks hold every layer and head of a block).
func benchKVSum(w io.Writer, drv *cuda.Lib, dev int, stream cuda.Stream, src cuda.DevicePtr, bsz uint64, blocks, reps int, base time.Duration, label string) error {
	const hsb = 256
	if bsz%(2*hsb) != 0 {
		return nil // not whole head slots: no row
	}
	perm := rand.New(rand.NewPCG(9, 2)).Perm(blocks)
	tasks := make([]cuda.SumTask, blocks)
	for i, b := range perm {
		tasks[i] = cuda.SumTask{Base: src + cuda.DevicePtr(uint64(b)*bsz), KVStride: bsz / 2, SlotStride: hsb,
			NumLayers: 1, NumHeads: 1, Slots: uint32(bsz / 2 / hsb), Out: uint32(i)}
	}
	sums := make([]uint64, blocks)
	shape := cuda.SumShape{KVHeads: 1, Words: hsb / 8}
	var ds []time.Duration
	for r := 0; r < reps+1; r++ { // the first is a warm-up
		start := time.Now()
		if err := drv.KVSum(dev, stream, shape, tasks, sums); err != nil {
			return fmt.Errorf("KV sum kernel: %w", err)
		}
		if r > 0 {
			ds = append(ds, time.Since(start))
		}
	}
	sort.Slice(ds, func(a, b int) bool { return ds[a] < ds[b] })
	d := ds[len(ds)/2]
	bytes := float64(bsz) * float64(blocks)
	fmt.Fprintf(w, "%-12s %-28s %10s %10.1f %8.0f%%\n", label, "scattered, check's hash (read)", d.Round(time.Microsecond), bytes/d.Seconds()/1e9, 100*base.Seconds()/d.Seconds())
	return nil
}

// checkBlocks compares sampled source blocks with where perm sent them.
func checkBlocks(drv *cuda.Lib, srcDev, dstDev int, src, dst cuda.DevicePtr, bsz uint64, perm []int) error {
	blocks := len(perm)
	got := make([]byte, bsz)
	want := make([]byte, bsz)
	for k := 0; k < 8; k++ {
		i := (k * 7919) % blocks
		if err := drv.DtoH(dstDev, got, dst+cuda.DevicePtr(uint64(perm[i])*bsz)); err != nil {
			return err
		}
		if err := drv.DtoH(srcDev, want, src+cuda.DevicePtr(uint64(i)*bsz)); err != nil {
			return err
		}
		if string(got) != string(want) {
			return fmt.Errorf("block %d did not arrive intact at target block %d", i, perm[i])
		}
	}
	return nil
}

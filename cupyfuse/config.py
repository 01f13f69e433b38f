"""Every switch and tuning constant of cupyfuse, in one place.

Each is read where it is used at the moment it is used, so a test (or a user
measuring a variant) may set it for a while: ``monkeypatch.setattr(config, "FUSE_TAIL",
False)``. Environment variables: ``CUPYFUSE_ENGINE`` (``auto`` / ``sm90`` / ``cublas``:
the GEMM engine, read per call), ``CUPYFUSE_CERTIFY`` (``0``: no certified row maxima,
read at import), ``CUPYFUSE_BACKWARD_PROGRAM`` (``BACKWARD_PROGRAM``'s value, read at
import), ``CUPYFUSE_KERNELS_DIR`` (where the CUDA sources are).
"""
from __future__ import annotations

import os

# --- Code generation (the tail kernels) --------------------------------------------------
#: epilogues are generated at all (False: every level is a kernel of its own after the GEMM)
EPILOGUES = True
#: the most transcendental functions per element (the op table's cost, summed over the
#: element's values) an epilogue takes: the two consumer warpgroups run it while the
#: tensor cores wait, where the separate tail kernel hides its math behind memory (H100,
#: KernelBench sizes: 0-1 per element 2.6-8% faster than the separate
#: kernel; 3 (silu, tanh, gelu: 95) 5% slower; 6 (mish, mish: 29) 12% slower)
EPI_MAX_COST = 2
#: the static shared memory a kernel's staged group results may take (bytes; the limit
#: is 48 KB): a split reduction past it re-reads its groups where used
SHARED_BUDGET = 40 * 1024
#: sequence reductions inside their level's kernel where :func:`_inline_seqreds` allows
#: (False: each its own seq_reduce launch, as before; tests compare the two bitwise)
SEQ_INLINE = True
#: the most loads a thread of a level kernel makes for a sequence reduction inside it per
#: row (seq x its features per thread): past it the reduction keeps its own launch, whose
#: threads (one per batch element and feature) spread a small batch over the whole GPU
#: where the level kernel has one block per row
SEQ_INLINE_LOADS = 128
#: rows split over a cluster of blocks (Level.launch): SPLIT_PARTS blocks per row for
#: levels whose rows are at least SPLIT_MIN_WIDTH wide, at batches of at most
#: SPLIT_MAX_ROWS rows (prepared launches; the general path launches one block per row).
#: Levels with phases other than plain row reductions (group or split reductions, scans,
#: sequence reductions) are never split. SPLIT_THREADS: threads per block of the `_cl`
#: entry (at most the level's own). H100, 1024 -> 16384 Linear, tail kernel us (warm),
#: batch 1 / 9 / 16 (2026-11-26): GELU + softmax, one block per
#: row 19.3 / 19.2 / 18.8, 4 x 1024 10.5 / 10.5 / 10.6, 8 x 1024 9.6 / 10.2 / 12.3,
#: **8 x 512 9.7 / 9.5 / 10.7**, 8 x 256 11.5 / 11.4 / 12.2; sigmoid + sum 9.6 / 9.5 /
#: 9.1 -> 5.5 / 5.2 / 5.4 (8 x 512)
SPLIT_PARTS = 8
SPLIT_MIN_WIDTH = 4096
SPLIT_MAX_ROWS = 32
SPLIT_THREADS = 512
#: the `_cl` entry's row function (:func:`_cluster_row`) keeps values a later phase reads
#: again in registers, at most this many floats per thread
CACHE_FLOATS = 32

# --- Prepared launches (repeated calls) --------------------------------------------------
#: run a level's tail in the same launch as its skinny GEMM: the last min(batch, tiles,
#: FUSE_MAX_TAIL_BLOCKS) blocks to finish a tile run the tail rows, one row per block --
#: or all of a batch of at most FUSE_MAX_ROWS_PER_BLOCK rows in fewer blocks (a GEMM of
#: fewer tiles than rows: a tiny head Linear) -- else a second launch, one block per row,
#: is faster. Until 2026-11-26 up to 4 rows per block at any batch: at 64 rows (two per
#: tail block) the second launch measured faster (H100, cold L2,
#:; GPU us, two launches vs one): per-head LayerNorm + softmax
#: 15.3 vs 22.6, a cosine classifier's softmax 15.4 vs 20.2, 55's tail 21.1 vs 22.0, 56's
#: 28.0 vs 28.2
FUSE_TAIL = True
FUSE_MAX_TAIL_BLOCKS = 32
FUSE_MAX_ROWS_PER_BLOCK = 4
#: nor for rows wider than this. GPU time at batch 1 (H100, cold L2,
#: 56's tail): 1024 wide 15.9 us in one launch vs 13.5 in two, 2048 24.0 vs 20.5, 4096
#: 54 vs 44, 16384 438 vs 392; one launch saves host time (one Python launch, ~5 us),
#: which is what a narrow row's call costs
FUSE_MAX_WIDTH = 512
#: a tail kernel after the skinny GEMM is a programmatic dependent launch
#: (runtime.launch_dependent): it launches while the GEMM's last blocks run (they trigger
#: after their tile's loads, gemm_skinny.cuh's skinny_finish) and waits for the GEMM's end
#: (cf_grid_dependency_wait) before it reads anything. H100, 1024 -> 16384 Linear, model ms
#: (cold L2) (2026-11-26): GELU + softmax at 1 / 9 / 16 rows 0.0455 /
#: 0.0520 / 0.0546 -> 0.0443 / 0.0508 / 0.0533, sigmoid + sum 0.0418 / 0.0480 / 0.0501 ->
#: 0.0407 / 0.0470 / 0.0488
PDL_TAIL = True
#: an engine GEMM split along K whose only reader is the next tail kernel: the tail reads
#: the partial products itself (codegen.ksum_source), one launch fewer (no splitk_sum)
KSUM_IN_TAIL = True
#: ... and a skinny GEMM split along K whose only reader is the next tail kernel leaves
#: its partial sums to it (no combine by the GEMM's last blocks: their fences, tickets
#: and reads sat on the call's critical path). H100, 16384^2, 9-16 rows (2 K splits),
#: cold L2 (2026-11-26): 56 0.391-0.394 -> 0.386-0.387 ms,
#: GELU + softmax 0.392-0.395 -> 0.387-0.388 (1.10 -> 1.08x the fp32-weight floor)
SKINNY_KSUM = True
#: batches above the skinny kernel's up to this many rows -- or up to ENGINE_MAX_MK
#: elements of x -- get prepared launches of the tensor-core engine (3xTF32 with
#: round-to-nearest big halves, x's split copies kept in the workspace); beyond, the GPU
#: time dominates and the general path runs. (H100: gen, 4096 x 1024, took 0.237 ms
#: through the general path, of which 130 us GPU time: host-bound.)
ENGINE_MAX_M = 512
ENGINE_MAX_MK = 1 << 22
#: ... or up to this many multiply-adds (a narrow GEMM of a long x, as 98's folded one:
#: 1024 x 512 x 8192, ~0.13 ms of GPU time, was host-bound through the general path)
ENGINE_MAX_MNK = 1 << 32
#: a call's workspace is kept for the next call up to this size, and all kept workspaces
#: together up to WS_KEEP_TOTAL (beyond, the buffers come from torch's caching allocator
#: each call: ~8 us per buffer and the engine's tensor maps encoded again -- measured on 39
#: at 4096 x 1024, ~100 MB of buffers: ~0.3 ms of host time per call for 0.12 ms of GPU
#: work, when the limit was 64 MB). cupyfuse.clear_cache() gives them all back.
WS_KEEP_BYTES = 256 << 20
WS_KEEP_TOTAL = 1 << 30

# --- GEMM dispatch (which kernel runs a GEMM) --------------------------------------------
#: "highest" runs the hybrid 3xTF32 kernel (the weight's small half in bf16: 1.5x the
#: weight's memory and traffic instead of 2x). TRUNC_BIG: the big halves are the fp32
#: operands themselves, which the tensor cores read as tf32 by truncation, so only the
#: small halves are made (x: small in tf32 and a bf16 copy per call; the weight: its small
#: half in bf16, cached -- 0.5x its memory).
#: False: big = round-to-nearest tf32 copies (the weight cached as tf32 big + bf16 small,
#: 1.5x its memory).
TRUNC_BIG = True
#: ... except for batches of at most this many rows, which are bound by streaming the
#: weight: there the round-to-nearest copies measured faster with the same bytes (H100,
#: 128 x 16388 x 32768: 1.24-1.27 vs 1.28-1.47 ms over four runs; 128 x 32768^2: 2.47-2.57
#: vs 2.50-2.86) -- plausibly less energy moving words whose low 13 bits are zero, at the
#: power limit these kernels run at. The cost: the weight's cache is 1.5x its size, not 0.5x.
ROUNDED_BIG_MAX_M = 256
#: a backward's GEMM operand (a transposed weight, an activation) is split for 3xTF32 in
#: the call itself from this many rows on (fewer: cuBLAS float32, which reads it once; the
#: split's three passes over it cost about what the engine saves on the products below)
SPLIT_EACH_CALL_MIN_M = 256
#: Batches of at most this many rows run the skinny kernel (``engine.gemm_skinny``:
#: plain fp32 FMAs, each weight element read once, one launch) at every precision: they
#: stream the weight, and 3xTF32 would stream 1.5x its bytes plus the split of x.
SKINNY_MAX_M = 16
#: ... and so do batches up to SKINNY_SMALL_MAX_M rows when the weight has at most
#: SKINNY_SMALL_W elements: launch-bound sizes, where one launch beats the engine's
#: split + GEMM (+ split-K sum).
SKINNY_SMALL_MAX_M = 64
SKINNY_SMALL_W = 1 << 22
#: rows per tile for batches of up to SKINNY_ROW_TILES x SKINNY_TILE_ROWS rows: short tiles,
#: side by side in launch order (their weight rows come from L2 after the first), need
#: fewer accumulator registers than one tall tile; taller batches take one tile of 16, on
#: the tensor cores (H100, cold L2, ratio to the fp32-weight floor,
#: 2026-11-26: 9-12 rows of 16384^2 in three 4-row FMA tiles 1.21x, in the 16-row wgmma
#: tile 1.08x; 32768 x 8192 1.25 -> 1.05x; 8 rows stay in FMA tiles, 1.07x)
SKINNY_TILE_ROWS = 4
SKINNY_ROW_TILES = 2
#: ... and for a weight of at most SKINNY_L2_W elements (16 MB: it stays in L2, so every
#: row tile re-reads it from there) up to SKINNY_L2_ROW_TILES tiles of config.SKINNY_TILE_ROWS
#: (H100, cold L2, 2026-11-26; GPU us of the whole call, one
#: 16-row tile per 16 rows -> 4-row tiles): 56 at 1024 features, 16 rows 18.2 -> 14.8,
#: 64 rows 28.2 -> 18.7; mean pooling over 16 positions at batch 1 24.9 -> 20.8; per-head
#: LayerNorm + softmax at 32 rows 17.0 -> 13.3; 1-8 rows unchanged
SKINNY_L2_W = 1 << 22
SKINNY_L2_ROW_TILES = 16
#: the shortest K range a skinny block takes when K is split over blocks (a multiple of
#: the 128 elements a warp's lanes read per step)
SKINNY_MIN_KSPAN = 512

# --- Runtime and fast paths --------------------------------------------------------------
#: print a line to stderr when a new generated kernel takes longer than this to compile
#: (seconds)
COMPILE_NOTICE_S = 1.0
#: False: launch_dependent launches plainly (after the previous kernel has finished)
DEPENDENT_LAUNCHES = True
#: False: never build specialised calls (every call takes the general fast path)
FASTPATH = True

# --- Certified row maxima ----------------------------------------------------------------
#: False (or CUPYFUSE_CERTIFY=0 in the environment at import): such GEMMs keep the
#: 3xTF32 engine (A/B comparisons; part of gemm.dispatch_key, so prepared launches follow)
CERTIFY = os.environ.get("CUPYFUSE_CERTIFY", "1") != "0"
#: True: each certification on the general path fills ``last_counts`` (int32 per row:
#: columns recomputed, -1 for a row left to fold_rows's guard) -- for tests and probes
CERTIFY_RECORD = False
#: the widest GEMM output certified (the candidate mask: one bit per column in shared memory)
CERTIFY_MAX_WIDTH = 1 << 18
#: the most K splits the kernel sums (tail_certify.cuh's CF_CERT_MAX_SPLITS; the engine's
#: _splits_for takes at most 16)
CERTIFY_MAX_SPLITS = 16

# --- The four named ops ------------------------------------------------------------------
#: False: the named ops skip the early
#: prepared-launch lookup (the ops' generic programs find their prepared launches anyway)
GENERIC_SMALL_BATCHES = True

# --- Gradients -----------------------------------------------------------------------
#: where a differentiated call's backward runs its *backward program*
#: (cupyfuse.ir.derivative: the op records' derivatives, one row-wise program, then the
#: weight gradients as products) rather than torch's autograd over the recomputed forward:
#: "none" (the default), "cpu" (CPU tensors), "all" (CUDA too: the backward program as
#: generated kernels on the general path). Not the default: on the CPU it lost to the
#: recompute (torch's fused norm and softmax backward kernels against one torch op per
#: primitive: 43.3 vs 31.6 ms a step at 512 x 1024 -> 1024, GELU + LayerNorm + softmax, 2
#: threads, 2026-12-08); on CUDA it is untimed (tests/api/test_derivative_gpu.py checks
#: it there, tools/device_full.sh times it).
BACKWARD_PROGRAM = os.environ.get("CUPYFUSE_BACKWARD_PROGRAM", "none")
#: the most value evaluations per element (ir.derivative.Backward.evaluations) of a
#: backward program run as generated kernels; past it the call takes the recompute (the
#: drawn tails' backward programs: 6-2000; every op of the table summed: ~2100; with
#: chunks, joins and logsumexp after them: 10^5-10^6, where nvcc's compile ran out of
#: memory)
BACKWARD_MAX_EVALUATIONS = 20000

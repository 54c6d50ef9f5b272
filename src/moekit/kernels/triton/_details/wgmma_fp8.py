"""Gluon (Triton's tile-level dialect) code of the block-128 FP8 prefill GEMMs, for Hopper (sm_90).

Why Gluon: with 1x128 activation and 128x128 weight scales, each 128-deep K-step's product must be
scaled into the fp32 accumulator ("promotion"). `tl.dot` waits for every wgmma in flight before any
non-dot use of its result, so the tensor cores idle while the promotion runs. Here the wgmma of step
k + 1 is in flight while step k is promoted (`warpgroup_mma_wait(num_outstanding=1)`), a one-warp TMA
producer partition keeps a ring of NUM_STAGES shared-memory stages full, and two math warpgroups
share each stage.

Data flow (rows are the alignment's sorted order: each expert's pairs padded to whole 64-row blocks):
  x_sorted fp8 [R, H] + scales [R, H/128] (`quant._quant_fp8_groups_sorted`)
  -> `wgmma_fp8_gemm1._fp8_gemm1` -> h fp8 [R, I] + scales [R, I/128] (activation and quantization in
     its epilogue) -> `wgmma_fp8_gemm2._fp8_gemm2` -> y[pair] * router weight.
This module holds what both share: the promoted K-loop of one math warpgroup (and its unscaled twin for
per-channel W8A8, `wgmma_fp8_channel`) and the TMA producer.
The K-loop (`_promoted_kloop`) runs windows of two K-steps (K a multiple of 256): ptxas serializes
every wgmma of a loop when an accumulator stays in flight across the loop's back-edge while other code
reads accumulators, so nothing is in flight across it.
"""

from moekit.kernels.triton._details.gemm import _block_first_row, _grouped_pid
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SCALE_GROUP = gl.constexpr(128)  # the K-step: one activation and one weight scale group
ROWS_PER_WARPGROUP = gl.constexpr(64)  # wgmma's M


@gluon.constexpr_function
def _mma_layout(BN):
    """One warpgroup's wgmma accumulator layout, 64 x BN."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])


@gluon.jit
def _issue_mma(k, ring, A_ROW0: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Wait for stage k's data, start the wgmma of 64 rows (from A_ROW0 of the A stage) x BN columns."""
    a_smem, b_smem, ready, _ = ring
    s = k % NUM_STAGES
    mbarrier.wait(ready.index(s), (k // NUM_STAGES) & 1)
    a_tile = a_smem.index(s)
    if a_smem.shape[1] != ROWS_PER_WARPGROUP:
        a_tile = a_tile.slice(A_ROW0, ROWS_PER_WARPGROUP, dim=0)
    zero = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, _mma_layout(BN))
    return warpgroup_mma(a_tile, b_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _promoted_kloop(
    ring,
    scales,
    row0,
    T0,
    KT: gl.constexpr,
    A_ROW0: gl.constexpr,
    BN: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """sum over K-steps k of (A_k @ B_k^T) * a_scale[row, k] * w_scale[k] in fp32 for this warpgroup's 64
    rows (sorted rows row0 + A_ROW0 on); K-step k is the ring's step T0 + k (a persistent program's
    earlier tiles took the steps before). `ring`: (A stages, weight stages, ready and empty barriers);
    `scales`: (a_scale_ptr, its row stride, this tile's weight scales, their K stride). Each stage is
    handed back (`empty`) as soon as this warpgroup's wgmma of it has retired."""
    empty = ring[3]
    a_scale_ptr, stride_asm, w_scale_ptr, stride_wsk = scales
    layout: gl.constexpr = _mma_layout(BN)
    rows = row0 + A_ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
    a_scales = a_scale_ptr + rows.to(gl.int64) * stride_asm
    acc = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)
    done = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)  # step k - 1's product, retired
    done_scale = gl.zeros([ROWS_PER_WARPGROUP], gl.float32, gl.SliceLayout(1, layout))
    for i in range(0, KT // 2):
        k = 2 * i
        first = _issue_mma(T0 + k, ring, A_ROW0, BN, NUM_STAGES)
        acc = acc + done * done_scale[:, None]
        second = _issue_mma(T0 + k + 1, ring, A_ROW0, BN, NUM_STAGES)
        first_scale = gl.load(a_scales + k) * gl.load(w_scale_ptr + k * stride_wsk)
        done_scale = gl.load(a_scales + k + 1) * gl.load(w_scale_ptr + (k + 1) * stride_wsk)
        product = warpgroup_mma_wait(num_outstanding=1, deps=(first,))
        mbarrier.arrive(empty.index((T0 + k) % NUM_STAGES), count=1)
        acc = acc + product * first_scale[:, None]
        done = warpgroup_mma_wait(num_outstanding=0, deps=(second,))
        mbarrier.arrive(empty.index((T0 + k + 1) % NUM_STAGES), count=1)
    return acc + done * done_scale[:, None]


@gluon.jit
def _summed_kloop(
    ring, T0, KT: gl.constexpr, A_ROW0: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """sum over K-steps k of A_k @ B_k^T in fp32, the unscaled twin of `_promoted_kloop` for per-token
    activation and per-channel (or per-tensor) weight scales: those are constant along K, so the caller
    multiplies the sum once; each 128-deep step's product is still added into the fp32 accumulator on
    its own (Hopper's FP8 wgmma sums are reduced-precision), step k + 1's wgmma in flight meanwhile."""
    empty = ring[3]
    layout: gl.constexpr = _mma_layout(BN)
    acc = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)
    done = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)  # step k - 1's product, retired
    for i in range(0, KT // 2):
        k = 2 * i
        first = _issue_mma(T0 + k, ring, A_ROW0, BN, NUM_STAGES)
        acc = acc + done
        second = _issue_mma(T0 + k + 1, ring, A_ROW0, BN, NUM_STAGES)
        product = warpgroup_mma_wait(num_outstanding=1, deps=(first,))
        mbarrier.arrive(empty.index((T0 + k) % NUM_STAGES), count=1)
        acc = acc + product
        done = warpgroup_mma_wait(num_outstanding=0, deps=(second,))
        mbarrier.arrive(empty.index((T0 + k + 1) % NUM_STAGES), count=1)
    return acc + done


@gluon.jit
def _release_stages(ring, T0, KT: gl.constexpr, NUM_STAGES: gl.constexpr):
    """A math warpgroup with no rows of its own in this block: hand the ring's steps T0 .. T0 + KT - 1
    back as they land (the ring's empty barriers count every consumer), so that the producer and the
    other warpgroup run on."""
    ready, empty = ring[2], ring[3]
    for k in range(KT):
        s = (T0 + k) % NUM_STAGES
        mbarrier.wait(ready.index(s), ((T0 + k) // NUM_STAGES) & 1)
        mbarrier.arrive(empty.index(s), count=1)


@gluon.jit
def _loader(
    descriptors, a_smem, b_smems, ready, empty, row_a, w_rows, KT: gl.constexpr, NUM_STAGES: gl.constexpr
):
    """The producer partition (one warp): per K-step, the A tile (rows row_a on) and one weight tile per
    entry of `w_rows` (its first weight row) into `b_smems` (a ring each), all in the next free stage.
    `descriptors`: (A's, the weights')."""
    for k in range(KT):
        _load_step(descriptors, a_smem, b_smems, ready, empty, k, k, row_a, w_rows, NUM_STAGES)


@gluon.jit
def _load_step(descriptors, a_smem, b_smems, ready, empty, t, k, row_a, w_rows, NUM_STAGES: gl.constexpr):
    """Ring step t: K-step k of the A tile (rows row_a on) and of one weight tile per entry of `w_rows`,
    into the step's stage once every consumer has handed it back."""
    a_desc, w_desc = descriptors
    NUM_B: gl.constexpr = len(w_rows)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + NUM_B * w_desc.block_type.nbytes
    s = t % NUM_STAGES
    # A fresh barrier's phase 1 counts as complete: the first pass over the ring does not wait.
    mbarrier.wait(empty.index(s), ((t // NUM_STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, nbytes)
    BK: gl.constexpr = a_desc.block_type.shape[1]  # SCALE_GROUP for FP8, 64 for the 16-bit engine
    tma.async_copy_global_to_shared(a_desc, [row_a, k * BK], bar, a_smem.index(s))
    for j in gl.static_range(NUM_B):
        tma.async_copy_global_to_shared(w_desc, [w_rows[j], k * BK], bar, b_smems[j].index(s))


@gluon.jit
def _ring(
    a_desc,
    w_desc,
    NUM_B: gl.constexpr,
    BOXES: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr,
):
    """Shared memory of a NUM_STAGES-deep ring: A stages, NUM_B weight stage rings (a stage BOXES of the
    weight descriptor's boxes stacked along its rows), and the ready (the producer's TMA landed) and
    empty (all CONSUMERS warpgroups' wgmma retired) barriers."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    stage: gl.constexpr = [NUM_STAGES, BOXES * w_desc.block_type.shape[0], w_desc.block_type.shape[1]]
    first = gl.allocate_shared_memory(w_desc.dtype, stage, w_desc.layout)
    b_smems = (first,)
    if NUM_B == 2:
        second = gl.allocate_shared_memory(w_desc.dtype, stage, w_desc.layout)
        b_smems = (first, second)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return a_smem, b_smems, ready, empty


@gluon.jit
def _persistent_loader(
    descriptors, ring, blocks, tiles, HIDDEN: gl.constexpr, KT: gl.constexpr, GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):  # fmt: skip
    """The producer of a persistent GEMM2 program (both engines'): each tile's K-steps, the ring's steps
    counted on across tiles, so the next tile's first stages land while the math warpgroups store the
    last one. `blocks`: block experts, block starts (None: the alignment's own blocks), -, valid count."""
    a_smem, b_smem, ready, empty = ring
    block_expert_ptr, block_start_ptr, _, num_valid = blocks
    first, stride, count, num_pid_n = tiles
    BN: gl.constexpr = descriptors[1].block_type.shape[0]
    BLOCK_M: gl.constexpr = a_smem.shape[1]
    t = 0
    for tile in range(first, count, stride):
        pid_m, pid_n = _grouped_pid(tile, num_valid, num_pid_n, GROUP_M)
        row0 = _block_first_row(block_start_ptr, pid_m, BLOCK_M)
        w_rows = (gl.load(block_expert_ptr + pid_m) * HIDDEN + pid_n * BN,)
        for k in range(KT):
            _load_step(descriptors, a_smem, (b_smem,), ready, empty, t, k, row0, w_rows, NUM_STAGES)
            t += 1

"""GEMM1 of the WGMMA_FP8 engine on 128 sorted rows (Gluon, sm_90): h = act(x @ w13[e]^T), quantized.

Why a second GEMM1: the 64-row GEMM1 (`wgmma_fp8_gemm1`) reads 8 KiB of x and 32 KiB of weights from L2
a K-step for 64 x 256 x 128 MACs. Here a program is 128 rows (`align.paired_blocks`, one math
warpgroup per 64 rows, sharing the weight stage) against 128 weight rows: 64 gate rows and the 64 up
rows of the same h columns, landed by two TMA boxes into one [128, 128] stage, so that each warpgroup's
single wgmma (N = 128) yields gate in columns 0-63 and up in 64-127. That is 16 + 16 KiB a K-step for
the same MACs: a fifth less L2-to-SM traffic a FLOP.

A 1x128 quantization group of h is 128 columns, two such 64-column halves: the program runs the K-loop
twice over the same 128 h columns (the ring runs on across both passes), keeps the first half's
act(gate, up) in shared memory, and quantizes both halves together after the second pass: the same
group maximum and the same arithmetic (`quant._fp8_scale`, `quant._fp8_codes`) as the 64-row GEMM1,
so h's FP8 codes are the same. The weight block scales of both halves are the same two (gate, up): the
promotion scales columns 0-63 by the gate block's scale and 64-127 by the up block's.

One tile a program, unlike the persistent GEMM2: a persistent form (a program an SM walking the tiles
with the grid as stride, the ring running on across tiles) spent 4 - 9 % longer in this kernel on an
H200 (DeepSeek-V3 T = 2048 / 4096 / 16384: 2069 -> 2181, 2935 -> 3190, 9253 -> 10032 us; the outputs
equal). Its long tiles (2 x H / 128 K-steps) leave little launch latency to hide. Nor does an expert's
odd last 64-row block give each warpgroup one pass over those rows on interleaved ring steps (the
second handing its half of h over): that was 21 - 34 % slower in this kernel (DeepSeek-V3 T = 2048 /
4096: 1965 -> 2419, 2799 -> 3572 us), each warpgroup then half the ring deep and x read twice.
"""

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.gemm import _grouped_pid
from moekit.kernels.triton._details.quant import _fp8_codes, _fp8_scale
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _issue_mma,
    _mma_layout,
    _release_stages,
    _ring,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma_wait

HALF: gl.constexpr = gl.constexpr(64)  # h columns a pass: the gate (and the up) rows of one TMA box


@gluon.jit
def _gate_up_kloop(ring, scales, row0, T0, KT: gl.constexpr, A_ROW0: gl.constexpr, NUM_STAGES: gl.constexpr):
    """One pass of this warpgroup (64 rows from A_ROW0): fp32 [64, 128], gate in columns 0-63 and up in
    64-127, summed over K-steps k of the product times x's row scale and the column's weight block
    scale; the ring's steps are T0 + k. Windows of two steps as `wgmma_fp8._promoted_kloop`."""
    empty = ring[3]
    a_scale_ptr, stride_asm, gate_scale_ptr, up_scale_ptr, stride_wsk = scales
    BN: gl.constexpr = 2 * HALF
    layout: gl.constexpr = _mma_layout(BN)
    # A 64-bit base for the warpgroup's first row, 32-bit offsets from it: per-thread 64-bit row
    # arithmetic kept alive across both passes spilled.
    rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
    a_scales = a_scale_ptr + (row0 + A_ROW0).to(gl.int64) * stride_asm + rows * stride_asm
    is_gate = (gl.arange(0, BN, layout=gl.SliceLayout(0, layout)) < HALF)[None, :]
    acc = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)
    done = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)  # step k - 1's product, retired
    done_a = gl.zeros([ROWS_PER_WARPGROUP], gl.float32, gl.SliceLayout(1, layout))
    done_g = 0.0
    done_u = 0.0
    for i in range(0, KT // 2):
        k = 2 * i
        first = _issue_mma(T0 + k, ring, A_ROW0, BN, NUM_STAGES)
        acc = acc + done * (done_a[:, None] * gl.where(is_gate, done_g, done_u))
        second = _issue_mma(T0 + k + 1, ring, A_ROW0, BN, NUM_STAGES)
        first_a = gl.load(a_scales + k)
        first_g = gl.load(gate_scale_ptr + k * stride_wsk)
        first_u = gl.load(up_scale_ptr + k * stride_wsk)
        done_a = gl.load(a_scales + k + 1)
        done_g = gl.load(gate_scale_ptr + (k + 1) * stride_wsk)
        done_u = gl.load(up_scale_ptr + (k + 1) * stride_wsk)
        product = warpgroup_mma_wait(num_outstanding=1, deps=(first,))
        mbarrier.arrive(empty.index((T0 + k) % NUM_STAGES), count=1)
        acc = acc + product * (first_a[:, None] * gl.where(is_gate, first_g, first_u))
        done = warpgroup_mma_wait(num_outstanding=0, deps=(second,))
        mbarrier.arrive(empty.index((T0 + k + 1) % NUM_STAGES), count=1)
    return acc + done * (done_a[:, None] * gl.where(is_gate, done_g, done_u))


@gluon.jit
def _half_h(acc, ACTIVATION: gl.constexpr, ALPHA: gl.constexpr, HAS_LIMIT: gl.constexpr, LIMIT: gl.constexpr):
    """act(gate, up) fp32 [64, 64] of a pass's [64, 128] result (gate columns 0-63, up 64-127): each
    thread holds column c and c + 64 of its rows, so the split moves no data."""
    pairs = gl.permute(gl.reshape(acc, [ROWS_PER_WARPGROUP, 2, HALF]), [0, 2, 1])
    gate, up = gl.split(pairs)
    return _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)


@gluon.jit
def _store_h(h_out, row, first, second):
    """h's FP8 codes and scales of 64 rows from `row` on: both 64-column halves of the program's 1x128
    group (`first`, `second`: act(gate, up) in fp32), quantized together."""
    h_ptr, h_scale_ptr, pid_n, stride_hm, stride_hsm, _ = h_out
    amax = gl.maximum(gl.max(gl.abs(first), axis=1), gl.max(gl.abs(second), axis=1))
    scale = _fp8_scale(amax)
    rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, first.type.layout))
    gl.store(h_scale_ptr + row.to(gl.int64) * stride_hsm + rows * stride_hsm + pid_n, scale)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, store_layout))
    cols = pid_n * (2 * HALF) + gl.arange(0, HALF, layout=gl.SliceLayout(0, store_layout))
    at = h_ptr + row.to(gl.int64) * stride_hm + (rows * stride_hm)[:, None] + cols[None, :]
    gl.store(at, gl.convert_layout(_fp8_codes(first, scale[:, None]), store_layout))
    gl.store(at + HALF, gl.convert_layout(_fp8_codes(second, scale[:, None]), store_layout))


@gluon.jit
def _tall_math(
    ring,
    scales,
    row0,
    stash,
    h_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup: rows [ROW0, ROW0 + 64) of the block, both passes, then h's codes and scale of
    the 128 columns (`h_out`: h, h scales, N-tile, their row strides, the block expert's end row); or
    only the ring's stages handed back if those rows are past the expert's end."""
    rows_end = h_out[5]
    if row0 + ROW0 >= rows_end:
        _release_stages(ring, 0, 2 * KT, NUM_STAGES)
    else:
        first = _half_h(
            _gate_up_kloop(ring, scales, row0, 0, KT, ROW0, NUM_STAGES), ACTIVATION, ALPHA, HAS_LIMIT, LIMIT
        )
        # Through shared memory, not registers: the second pass holds three accumulators already.
        mine = stash.slice(ROW0, ROWS_PER_WARPGROUP, dim=0)
        mine.store(first)
        second = _half_h(
            _gate_up_kloop(ring, scales, row0, KT, KT, ROW0, NUM_STAGES), ACTIVATION, ALPHA, HAS_LIMIT, LIMIT
        )
        _store_h(h_out, row0 + ROW0, mine.load(second.type.layout), second)


@gluon.jit
def _tall_loader(
    descriptors,
    ring,
    row_a,
    gate_row,
    up_row,
    KT: gl.constexpr,
    PASSES: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """The producer partition (one warp): ring step t = pass * KT + k (PASSES passes over K) holds x's rows
    row_a on at K-step k, and the pass's 64 gate rows and 64 up rows (from gate_row + 64 * pass,
    up_row + 64 * pass) as the halves of one weight stage."""
    for t in range(PASSES * KT):
        n = (t // KT) * HALF
        _gate_up_step(descriptors, ring, t, t % KT, row_a, gate_row + n, up_row + n, NUM_STAGES)


@gluon.jit
def _gate_up_step(descriptors, ring, t, k, row_a, gate_row, up_row, NUM_STAGES: gl.constexpr):
    """Ring step t: K-step k of x's rows row_a on, and of 64 gate rows and 64 up rows (from gate_row,
    up_row) as the halves of one weight stage, once every consumer has handed the stage back
    (`wgmma_fp8._load_step`'s wait and expect; the halves are views of one stage, so the copies are
    written here: a view of the whole ring sliced along the rows does not compile)."""
    x_desc, w_desc = descriptors
    a_smem, b_smem, ready, empty = ring
    nbytes: gl.constexpr = x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    s = t % NUM_STAGES
    # A fresh barrier's phase 1 counts as complete: the first pass over the ring does not wait.
    mbarrier.wait(empty.index(s), ((t // NUM_STAGES) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(x_desc, [row_a, k * SCALE_GROUP], bar, a_smem.index(s))
    stage = b_smem.index(s)
    tma.async_copy_global_to_shared(w_desc, [gate_row, k * SCALE_GROUP], bar, stage.slice(0, HALF))
    tma.async_copy_global_to_shared(w_desc, [up_row, k * SCALE_GROUP], bar, stage.slice(HALF, HALF))


@gluon.jit
def _fp8_gemm1_tall(
    x_desc,  # fp8 [R, H] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * 2I, H], block [64, 128]
    x_scale_ptr,  # fp32 [R, H/128]
    w_scale_ptr,  # fp32 [E_local, 2I/128, H/128] (any strides)
    h_ptr,  # out fp8 [R, I]
    h_scale_ptr,  # out fp32 [R, I/128]
    block_expert_ptr,  # int32 [num_pid_m]
    block_start_ptr,  # int32 [num_pid_m]
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]: each expert's padded rows start (its end: the next entry)
    num_pid_m,
    stride_xsm,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_hm,
    stride_hsm,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """h = act(x @ w13[e]^T) of one 128-row block (`paired_blocks`) and 128 columns of h (CONCAT: gate
    rows n, up rows I + n), quantized per 1x128 group."""
    gl.static_assert(w_desc.block_type.shape[0] == HALF)
    gl.static_assert(x_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    BN: gl.constexpr = 2 * HALF
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, INTER_SIZE // BN, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = gl.load(block_start_ptr + pid_m)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    KT: gl.constexpr = HIDDEN // SCALE_GROUP
    a_smem, weight_stages, ready, empty = _ring(x_desc, w_desc, 1, 2, NUM_STAGES, 2)
    stash = gl.allocate_shared_memory(
        gl.float32, [2 * ROWS_PER_WARPGROUP, HALF], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    )
    ring = (a_smem, weight_stages[0], ready, empty)
    block_scales = w_scale_ptr + expert.to(gl.int64) * stride_wse
    scales = (
        x_scale_ptr,
        stride_xsm,
        block_scales + pid_n * stride_wsn,
        block_scales + (INTER_SIZE // SCALE_GROUP + pid_n) * stride_wsn,
        stride_wsk,
    )
    h_out = (h_ptr, h_scale_ptr, pid_n, stride_hm, stride_hsm, rows_end)
    gate_row = expert * (2 * INTER_SIZE) + pid_n * BN
    gl.warp_specialize(
        [
            (
                _tall_math,
                (ring, scales, row0, stash, h_out, KT, 0, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, NUM_STAGES),
            ),
            (
                _tall_math,
                (
                    ring,
                    scales,
                    row0,
                    stash,
                    h_out,
                    KT,
                    ROWS_PER_WARPGROUP,
                    ACTIVATION,
                    ALPHA,
                    HAS_LIMIT,
                    LIMIT,
                    NUM_STAGES,
                ),
            ),
            (
                _tall_loader,
                ((x_desc, w_desc), ring, row0, gate_row, gate_row + INTER_SIZE, KT, 2, NUM_STAGES),
            ),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )

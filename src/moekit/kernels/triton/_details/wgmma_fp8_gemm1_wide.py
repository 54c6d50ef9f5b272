"""GEMM1 of the WGMMA_FP8 engine on 128 sorted rows x 128 columns of h (Gluon, sm_90), in one pass over K.

Why: GEMM1 on 128 x (64 gate + 64 up) tiles (`wgmma_fp8_gemm1_tall`) is held by the traffic from L2 into
the SMs (85 % of the L2's throughput on an H200 at DeepSeek-V3's T = 4096). Here a program is 128 sorted
rows (`align.paired_blocks`, one math warpgroup per 64) against 128 gate and 128 up rows: 16 KiB of x and
32 KiB of weights a K-step for twice the MACs, a quarter less traffic a FLOP, and a whole 1x128 group of
h a program (no second pass over K, no stash).

Each math warpgroup holds a gate and an up accumulator (64 x 128 fp32 each) and one product tile: the
step's gate wgmma lands in it, is scaled into the gate accumulator in fp32 registers, then the up wgmma
reuses it. That is the 64-row GEMM1's arithmetic in the same order, so h is the same, code for code.
FP8 wgmma accumulates with fewer bits than fp32, so a product is never added into a running sum by the
wgmma itself across K-steps (kept in units of the current step's scale and rescaled in place, the sum
drifted to a rel L2 of 1.3 - 1.5e-2 against the reference on an H200).
"""

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.gemm import _grouped_pid
from moekit.kernels.triton._details.quant import _fp8_group_codes
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _loader,
    _mma_layout,
    _release_stages,
    _ring,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

BN: gl.constexpr = gl.constexpr(128)  # h columns a program: one weight scale block, one h group


@gluon.jit
def _step_mma(a_tile, b_tile):
    """Start one K-step's wgmma (64 rows x 128 columns) into a fresh accumulator."""
    zero = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, _mma_layout(BN))
    return warpgroup_mma(a_tile, b_tile.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _wide_kloop(ring, scales, row, KT: gl.constexpr, A_ROW0: gl.constexpr, NUM_STAGES: gl.constexpr):
    """fp32 gate and up [64, 128] of this warpgroup's 64 rows (sorted rows from `row`; A_ROW0 in the A
    stage): sum over K-steps k of the step's product times x's row scale and the weight block scale,
    added in fp32 registers in K order, as `wgmma_fp8._promoted_kloop` does. One product register tile
    serves both: the gate product is promoted before the up wgmma starts, and the other math warpgroup's
    wgmma keeps the tensor cores busy meanwhile. The stage is handed back once the up wgmma retired."""
    a_smem, weight_stages, ready, empty = ring
    gate_smem, up_smem = weight_stages
    x_scale_ptr, stride_asm, gate_scale_ptr, up_scale_ptr, stride_wsk = scales
    layout: gl.constexpr = _mma_layout(BN)
    rows = gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
    a_scales = x_scale_ptr + row.to(gl.int64) * stride_asm + rows * stride_asm
    gate = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)
    up = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, layout)
    # Each step's scales are loaded a step ahead, so their latency hides behind the step before.
    next_a = gl.load(a_scales)
    next_g = gl.load(gate_scale_ptr)
    next_u = gl.load(up_scale_ptr)
    for k in range(KT):
        step_a = next_a
        step_g = next_g
        step_u = next_u
        ahead = gl.minimum(k + 1, KT - 1)
        next_a = gl.load(a_scales + ahead)
        next_g = gl.load(gate_scale_ptr + ahead * stride_wsk)
        next_u = gl.load(up_scale_ptr + ahead * stride_wsk)
        s = k % NUM_STAGES
        mbarrier.wait(ready.index(s), (k // NUM_STAGES) & 1)
        a_tile = a_smem.index(s).slice(A_ROW0, ROWS_PER_WARPGROUP, dim=0)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(_step_mma(a_tile, gate_smem.index(s)),))
        gate = gate + product * (step_a * step_g)[:, None]
        product = warpgroup_mma_wait(num_outstanding=0, deps=(_step_mma(a_tile, up_smem.index(s)),))
        mbarrier.arrive(empty.index(s), count=1)
        up = up + product * (step_a * step_u)[:, None]
    return gate, up


@gluon.jit
def _wide_math(
    ring,
    scales,
    row0,
    h_out,
    KT: gl.constexpr,
    ROW0: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup: rows [ROW0, ROW0 + 64) of the block, then h's FP8 codes and scale of the tile's
    128 columns (`h_out`: h, h scales, N-tile, their row strides, the block expert's end row); or only
    the ring's stages handed back if those rows are past the expert's end."""
    h_ptr, h_scale_ptr, pid_n, stride_hm, stride_hsm, rows_end = h_out
    if row0 + ROW0 >= rows_end:
        _release_stages(ring, 0, KT, NUM_STAGES)
    else:
        gate, up = _wide_kloop(ring, scales, row0 + ROW0, KT, ROW0, NUM_STAGES)
        codes, scale = _fp8_group_codes(_gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT))
        layout: gl.constexpr = _mma_layout(BN)
        rows = row0 + ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
        gl.store(h_scale_ptr + rows.to(gl.int64) * stride_hsm + pid_n, scale)
        # 16 bytes a thread along a row: the accumulator layout would store 2 bytes at a time.
        store_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        codes = gl.convert_layout(codes, store_layout)
        rows = row0 + ROW0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, store_layout))
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
        gl.store(h_ptr + rows.to(gl.int64)[:, None] * stride_hm + cols[None, :], codes)


@gluon.jit
def _fp8_gemm1_wide(
    x_desc,  # fp8 [R, H] sorted rows, block [128, 128]
    w_desc,  # fp8 [E_local * 2I, H], block [128, 128]
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
    gl.static_assert(w_desc.block_type.shape[0] == BN)
    gl.static_assert(x_desc.block_type.shape[0] == 2 * ROWS_PER_WARPGROUP)
    gl.static_assert(HIDDEN % (2 * SCALE_GROUP) == 0)
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, INTER_SIZE // BN, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = gl.load(block_start_ptr + pid_m)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    KT: gl.constexpr = HIDDEN // SCALE_GROUP
    a_smem, weight_stages, ready, empty = _ring(x_desc, w_desc, 2, 1, NUM_STAGES, 2)
    ring = (a_smem, weight_stages, ready, empty)
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
            (_wide_math, (ring, scales, row0, h_out, KT, 0, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, NUM_STAGES)),
            (
                _wide_math,
                (
                    ring,
                    scales,
                    row0,
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
                _loader,
                (
                    (x_desc, w_desc),
                    a_smem,
                    weight_stages,
                    ready,
                    empty,
                    row0,
                    (gate_row, gate_row + INTER_SIZE),
                    KT,
                    NUM_STAGES,
                ),
            ),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )

"""GEMM1 of the WGMMA_FP8 engine (Gluon, sm_90): h = act(x @ w13[e]^T), quantized per 1x128 group.

One program = 64 sorted rows x 128 columns of h: the gate warpgroup and the up warpgroup share each A
stage and read their own weight stage; the up accumulator crosses to the gate warpgroup through shared
memory, which applies the activation and `quant._fp8_group_codes` (the separate pass's arithmetic).
The K-loop, ring and producer are `wgmma_fp8`'s.
"""

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.gemm import _grouped_pid
from moekit.kernels.triton._details.quant import _fp8_group_codes
from moekit.kernels.triton._details.wgmma_fp8 import (
    ROWS_PER_WARPGROUP,
    SCALE_GROUP,
    _loader,
    _mma_layout,
    _promoted_kloop,
    _ring,
)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier


@gluon.jit
def _gemm1_math(
    ring,
    scales,
    row0,
    exchange,
    h_out,
    KT: gl.constexpr,
    GATE: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    NUM_STAGES: gl.constexpr,
):
    """One math warpgroup: the gate (GATE) or the up half of the tile. The up warpgroup hands its
    accumulator over (`exchange`: shared memory and a barrier; the arrive follows a barrier of the
    warpgroup, so every thread's store is in before it); the gate warpgroup then writes
    act(gate, up) as FP8 codes and scales (`h_out`: h, h scales, N-tile, their row strides)."""
    up_smem, up_ready = exchange
    BN: gl.constexpr = up_smem.shape[1]
    layout: gl.constexpr = _mma_layout(BN)
    acc = _promoted_kloop(ring, scales, row0, 0, KT, 0, BN, NUM_STAGES)
    if GATE:
        h_ptr, h_scale_ptr, pid_n, stride_hm, stride_hsm = h_out
        mbarrier.wait(up_ready, 0)
        up = up_smem.load(layout)
        codes, scale = _fp8_group_codes(_gated_activation(acc, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT))
        rows = row0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, layout))
        gl.store(h_scale_ptr + rows.to(gl.int64) * stride_hsm + pid_n, scale)
        # 16 bytes a thread along a row: the accumulator layout would store 2 bytes at a time.
        store_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
        codes = gl.convert_layout(codes, store_layout)
        rows = row0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, store_layout))
        cols = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
        gl.store(h_ptr + rows.to(gl.int64)[:, None] * stride_hm + cols[None, :], codes)
    else:
        up_smem.store(acc)
        mbarrier.arrive(up_ready, count=1)


@gluon.jit
def _fp8_gemm1(
    x_desc,  # fp8 [R, H] sorted rows, block [64, 128]
    w_desc,  # fp8 [E_local * 2I, H], block [128, 128]
    x_scale_ptr,  # fp32 [R, H/128]
    w_scale_ptr,  # fp32 [E_local, 2I/128, H/128] (any strides)
    h_ptr,  # out fp8 [R, I]
    h_scale_ptr,  # out fp32 [R, I/128]
    block_expert_ptr,  # int32 [num_pid_m]
    num_blocks_ptr,  # int32 [1]
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
    """h = act(x @ w13[e]^T) of one 64-row M-block and one 128-column N-tile of h, quantized per group."""
    BN: gl.constexpr = w_desc.block_type.shape[0]
    gl.static_assert(BN == SCALE_GROUP)  # one weight scale and one h scale group per tile
    gl.static_assert(x_desc.block_type.shape[0] == ROWS_PER_WARPGROUP)
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, INTER_SIZE // BN, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = pid_m * ROWS_PER_WARPGROUP
    expert = gl.load(block_expert_ptr + pid_m)
    KT: gl.constexpr = HIDDEN // SCALE_GROUP
    gate_row = expert * (2 * INTER_SIZE) + pid_n * BN
    a_smem, weight_stages, ready, empty = _ring(x_desc, w_desc, 2, 1, NUM_STAGES, 2)
    gate_smem = weight_stages[0]
    up_w_smem = weight_stages[1]
    up_smem = gl.allocate_shared_memory(
        gl.float32, [ROWS_PER_WARPGROUP, BN], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    )
    up_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
    mbarrier.init(up_ready, count=1)
    gate_scales = w_scale_ptr + expert.to(gl.int64) * stride_wse + pid_n * stride_wsn  # one 128-row block
    up_scales = gate_scales + (INTER_SIZE // SCALE_GROUP) * stride_wsn
    exchange = (up_smem, up_ready)
    h_out = (h_ptr, h_scale_ptr, pid_n, stride_hm, stride_hsm)
    gate_ring = (a_smem, gate_smem, ready, empty)
    up_ring = (a_smem, up_w_smem, ready, empty)
    gate_scale = (x_scale_ptr, stride_xsm, gate_scales, stride_wsk)
    up_scale = (x_scale_ptr, stride_xsm, up_scales, stride_wsk)
    weight_rows = (gate_row, gate_row + INTER_SIZE)
    gl.warp_specialize(
        [
            (
                _gemm1_math,
                (
                    gate_ring,
                    gate_scale,
                    row0,
                    exchange,
                    h_out,
                    KT,
                    True,
                    ACTIVATION,
                    ALPHA,
                    HAS_LIMIT,
                    LIMIT,
                    NUM_STAGES,
                ),
            ),
            (
                _gemm1_math,
                (
                    up_ring,
                    up_scale,
                    row0,
                    exchange,
                    h_out,
                    KT,
                    False,
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
                    (gate_smem, up_w_smem),
                    ready,
                    empty,
                    row0,
                    weight_rows,
                    KT,
                    NUM_STAGES,
                ),
            ),
        ],
        [4, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )

"""GEMM1 of the WGMMA_BF16 engine (Gluon, sm_90): h[row] = act(x[token] @ w13[e]^T (+ b13[e])) in the
alignment's sorted rows, for 16-bit float weights and activations, gate and up rows concatenated or
interleaved (two TMA descriptors over w13: the gate rows and the up rows, each of unit row step in its own
row space, so the kernel's tiles are the same for both layouts).

A program = 128 sorted rows x BN columns of h: two math warpgroups of 64 rows, each with a gate and an
up accumulator [64, BN] (two wgmma a K-step on one A stage and the stage's gate and up weight boxes), so
the activation runs in each warpgroup's registers; a 4-warp producer partition gathers the x rows of
each K-step with cp.async (TMA cannot gather rows on Hopper) and loads both weight boxes with TMA, into
a ring of NUM_STAGES stages. The x rows' copies arrive on their own barrier (each producer thread's
copies, `.noinc`), the weights' on another.
"""

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.gemm import _block_first_row, _grouped_pid
from moekit.kernels.triton._details.wgmma_bf16_gemm2 import STORE_LAYOUT, _mma_layout_16bit, _tile_rows
from moekit.kernels.triton._details.wgmma_fp8 import ROWS_PER_WARPGROUP
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOADER_WARPS = gl.constexpr(4)


@gluon.jit
def _gather_loader(
    x_ptr,
    gate_desc,
    up_desc,
    ring,
    tile,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    TOP_K: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    INTERLEAVED: gl.constexpr,
):
    """The producer: per K-step, the tile's 128 x rows (cp.async) and its gate and up weight boxes (TMA)
    into the next free stage."""
    a_smem, gate_smem, up_smem, ready_a, ready_b, empty = ring
    sorted_pairs_ptr, stride_xm, num_pairs, row0, rows_end, expert, pid_n = tile
    BLOCK_M: gl.constexpr = a_smem.shape[1]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = gate_smem.shape[1]
    KT: gl.constexpr = HIDDEN // BK
    # 16 bytes a thread a row segment: 128 rows x 64 columns over 4 warps
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADER_WARPS, 1], [1, 0])
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    # A paired block's second half may lie past the sorted rows' end: read no row past the expert's.
    pairs = gl.load(sorted_pairs_ptr + rows, mask=rows < rows_end, other=num_pairs)
    gl.static_assert(HIDDEN % BK == 0)  # whole K-steps: the copies need no mask
    # Padding rows and rows past the expert's read token 0: finite data, never stored.
    live = (pairs < num_pairs) & (rows < rows_end)
    # 16-byte copies: the launch passes x only with a 16-byte aligned address and row stride.
    x_rows = gl.where(live, pairs // TOP_K, 0).to(gl.int64)[:, None] * stride_xm
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    if INTERLEAVED:  # each descriptor's row e * I + j is gate (or up) row j of expert e
        gate_row = expert * INTER_SIZE + pid_n * BN
        up_row = gate_row
    else:  # one descriptor over w13's rows: expert e's gate rows, then its up rows
        gate_row = expert * (2 * INTER_SIZE) + pid_n * BN
        up_row = gate_row + INTER_SIZE
    nbytes: gl.constexpr = gate_desc.block_type.nbytes + up_desc.block_type.nbytes
    for k in range(KT):
        s = k % NUM_STAGES
        # A fresh barrier's phase 1 counts as complete: the first pass over the ring does not wait.
        mbarrier.wait(empty.index(s), ((k // NUM_STAGES) & 1) ^ 1)
        col = k * BK + cols
        async_copy.async_copy_global_to_shared(a_smem.index(s), x_ptr + (x_rows + col[None, :]))
        async_copy.mbarrier_arrive(ready_a.index(s), increment_count=False)
        mbarrier.expect(ready_b.index(s), nbytes)
        tma.async_copy_global_to_shared(gate_desc, [gate_row, k * BK], ready_b.index(s), gate_smem.index(s))
        tma.async_copy_global_to_shared(up_desc, [up_row, k * BK], ready_b.index(s), up_smem.index(s))


@gluon.jit
def _landed_stage(ring, k, NUM_STAGES: gl.constexpr):
    """K-step k's stage, once both its x rows (cp.async) and its weight boxes (TMA) have landed."""
    ready_a, ready_b = ring[3], ring[4]
    s = k % NUM_STAGES
    mbarrier.wait(ready_a.index(s), (k // NUM_STAGES) & 1)
    mbarrier.wait(ready_b.index(s), (k // NUM_STAGES) & 1)
    return s


@gluon.jit
def _gate_up_math(
    ring,
    tile,
    h_out,
    ROW0: gl.constexpr,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    EPILOGUE: gl.constexpr,
):
    """One math warpgroup: rows [ROW0, ROW0 + 64) of the tile, gate and up accumulated over K (the
    previous K-step's two wgmma retire while this step's run), then act(gate, up) stored at the rows of
    h (`h_out`: h, its row stride, b13, its expert stride, router weights). Past the expert's rows it only
    hands the ring's stages back."""
    a_smem, gate_smem, up_smem, _, _, empty = ring
    sorted_pairs_ptr, stride_xm, num_pairs, row0, rows_end, expert, pid_n = tile
    h_ptr, stride_hm, b_ptr, stride_be, route_w_ptr = h_out
    HAS_BIAS: gl.constexpr = EPILOGUE[0]
    ROUTE_ON_INPUT: gl.constexpr = EPILOGUE[1]
    ACTIVATION: gl.constexpr = EPILOGUE[2]
    ALPHA: gl.constexpr = EPILOGUE[3]
    HAS_LIMIT: gl.constexpr = EPILOGUE[4]
    LIMIT: gl.constexpr = EPILOGUE[5]
    INTERLEAVED: gl.constexpr = EPILOGUE[6]
    BK: gl.constexpr = a_smem.shape[2]
    BN: gl.constexpr = gate_smem.shape[1]
    KT: gl.constexpr = HIDDEN // BK  # whole K-steps (`_gather_loader`)
    mma_layout: gl.constexpr = _mma_layout_16bit(BN)
    if row0 + ROW0 >= rows_end:
        for k in range(KT):
            mbarrier.arrive(empty.index(_landed_stage(ring, k, NUM_STAGES)), count=1)
    else:
        gate = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, mma_layout)
        up = gl.zeros([ROWS_PER_WARPGROUP, BN], gl.float32, mma_layout)
        for k in range(KT):
            s = _landed_stage(ring, k, NUM_STAGES)
            fence_async_shared()  # the x rows came through cp.async (the generic proxy); wgmma reads async
            a_tile = a_smem.index(s).slice(ROW0, ROWS_PER_WARPGROUP, dim=0)
            gate = warpgroup_mma(a_tile, gate_smem.index(s).permute((1, 0)), gate, is_async=True)
            up = warpgroup_mma(a_tile, up_smem.index(s).permute((1, 0)), up, is_async=True)
            gate, up = warpgroup_mma_wait(num_outstanding=2, deps=(gate, up))
            if k > 0:
                mbarrier.arrive(empty.index((k - 1) % NUM_STAGES), count=1)
        gate, up = warpgroup_mma_wait(num_outstanding=0, deps=(gate, up))
        mbarrier.arrive(empty.index((KT - 1) % NUM_STAGES), count=1)
        gate = gl.convert_layout(gate, STORE_LAYOUT)
        up = gl.convert_layout(up, STORE_LAYOUT)
        rows, cols, pairs, live = _tile_rows(sorted_pairs_ptr, row0 + ROW0, rows_end, num_pairs, pid_n, BN)
        if ROUTE_ON_INPUT:  # (w * x) @ W^T == w * (x @ W^T), before the bias as the tl.dot path does
            route_w = gl.load(route_w_ptr + pairs, mask=live, other=0.0)[:, None]
            gate = gate * route_w
            up = up * route_w
        if HAS_BIAS:  # b13 [E, 2I] in w13's row order
            bias = b_ptr + expert.to(gl.int64) * stride_be
            if INTERLEAVED:
                gate_bias = bias + 2 * cols
                up_bias = gate_bias + 1
            else:
                gate_bias = bias + cols
                up_bias = gate_bias + INTER_SIZE
            gate = gate + gl.load(gate_bias, mask=cols < INTER_SIZE, other=0.0).to(gl.float32)[None, :]
            up = up + gl.load(up_bias, mask=cols < INTER_SIZE, other=0.0).to(gl.float32)[None, :]
        out = _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
        gl.store(
            h_ptr + rows.to(gl.int64)[:, None] * stride_hm + cols[None, :],
            out.to(h_ptr.dtype.element_ty),
            mask=live[:, None] & (cols < INTER_SIZE)[None, :],
        )


@gluon.jit
def _bf16_gemm1(
    x_ptr,  # [T, H] act dtype
    gate_desc,  # w13's gate rows, [BN, 64] boxes: [E_local * 2I, H] (CONCAT), [E_local * I, H] (INTERLEAVED)
    up_desc,  # w13's up rows: the same descriptor as gate_desc (CONCAT), or the up rows' [E_local * I, H]
    b_ptr,  # [E_local, 2I] or None
    route_w_ptr,  # fp32 [T*K] (INPUT placement, K == 1) or None
    h_ptr,  # out [R, I] act dtype, the alignment's sorted rows
    sorted_pairs_ptr,  # int32 [R]: pair id of each sorted row, num_pairs for padding
    block_expert_ptr,  # int32 [max_blocks]
    block_start_ptr,  # int32 [max_blocks], or None: block b starts at row 128 b
    num_blocks_ptr,  # int32 [1]
    expert_end_ptr,  # int64 [E_local + 1]
    num_pairs,
    num_pid_m,
    stride_xm,
    stride_hm,
    stride_be,
    HIDDEN: gl.constexpr,
    INTER_SIZE: gl.constexpr,
    TOP_K: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ROUTE_ON_INPUT: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
):
    """h = act(x @ w13[e]^T + b13[e]) for one (128-row block, BN columns) tile, rows in sorted order."""
    BN: gl.constexpr = gate_desc.block_type.shape[0]
    BK: gl.constexpr = gate_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = 2 * ROWS_PER_WARPGROUP
    pid_m, pid_n = _grouped_pid(gl.program_id(0), num_pid_m, (INTER_SIZE + BN - 1) // BN, GROUP_M)
    if pid_m >= gl.load(num_blocks_ptr):
        return
    row0 = _block_first_row(block_start_ptr, pid_m, BLOCK_M)
    expert = gl.load(block_expert_ptr + pid_m)
    rows_end = gl.load(expert_end_ptr + expert + 1).to(gl.int32)
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BK], x_ptr.dtype.element_ty)
    a_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [NUM_STAGES, BLOCK_M, BK], a_layout)
    gate_smem = gl.allocate_shared_memory(gate_desc.dtype, [NUM_STAGES, BN, BK], gate_desc.layout)
    up_smem = gl.allocate_shared_memory(up_desc.dtype, [NUM_STAGES, BN, BK], up_desc.layout)
    ready_a = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ready_b = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready_a.index(i), count=LOADER_WARPS * 32)  # each producer thread's copies
        mbarrier.init(ready_b.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    ring = (a_smem, gate_smem, up_smem, ready_a, ready_b, empty)
    tile = (sorted_pairs_ptr, stride_xm, num_pairs, row0, rows_end, expert, pid_n)
    h_out = (h_ptr, stride_hm, b_ptr, stride_be, route_w_ptr)
    epilogue: gl.constexpr = (HAS_BIAS, ROUTE_ON_INPUT, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT, INTERLEAVED)
    gl.warp_specialize(
        [
            (_gate_up_math, (ring, tile, h_out, 0, HIDDEN, INTER_SIZE, NUM_STAGES, epilogue)),
            (
                _gate_up_math,
                (ring, tile, h_out, ROWS_PER_WARPGROUP, HIDDEN, INTER_SIZE, NUM_STAGES, epilogue),
            ),
            (
                _gather_loader,
                (x_ptr, gate_desc, up_desc, ring, tile, HIDDEN, INTER_SIZE, TOP_K, NUM_STAGES, INTERLEAVED),
            ),
        ],
        [4, LOADER_WARPS],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )

"""The WGMMA_W4A8 engine's Gluon kernel (sm_90): one grouped GEMM of MXFP4 weights (`mxfp4_w4a8` packing)
against per-token FP8 activation rows in the alignment's sorted order, on FP8 wgmma. GEMM1 (GATED: the
gated activation of gate/up row pairs -> h in fp32, sorted rows) and GEMM2 (-> y in bf16, pair order,
times the router weight) are the same kernel.

A tile: 128 weight rows (the wgmma's M, register A) x BN sorted rows of one M-block (its N, B through a
TMA ring). A program walks the tiles its id strides over (one program an SM when the host launches
fewer programs than tiles), the ring's steps counted across tiles, so the next tile's rows load under the
last one's epilogue. Three partitions: two math warpgroups of 64 weight rows each and a one-warp TMA
producer. The math partitions hand each stage back through `empty` barriers, so they drift apart and
one's promotion runs under the other's wgmma. A block at most a quarter or half full runs its wgmma on
its first BN / 4 or BN / 2 rows (NARROW).

K-loop (`_kloop`), steps in pairs: both steps' words decode against one reference scale a row (the
largest of their 8 groups, packed offline with each group's drop below it), so both wgmmas accumulate into
one product; the next pair's decode is issued under them; after the wait the pair is promoted into the
fp32 sum times the row's 2^(s_ref - 133). An odd last step runs alone.
"""

from __future__ import annotations

from moekit.kernels.triton._details.activation import _gated_activation
from moekit.kernels.triton._details.w4a8_decode import STEP_K, _fragment, _table_bytes
from moekit.kernels.triton._details.wgmma_words import _tile_of
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

WORDS = gl.constexpr(8)  # words a thread a step: 4 groups x rows g and g + 8
MATH_WARPS = gl.constexpr(4)


@gluon.jit
def _step(weights, t, KT: gl.constexpr):
    """Step t's words and drops (t clamped to the last step)."""
    t = gl.minimum(t, KT - 1)
    return gl.load(weights[0] + t * 32 * WORDS), gl.load(weights[1] + t)


@gluon.jit
def _decode(step, shift):
    return _table_bytes(step[0], (step[1] >> shift) & 0xFF, False)


@gluon.jit
def _issue(
    ring,
    decoded,
    k,
    acc,
    USE_ACC: gl.constexpr,
    fragment: gl.constexpr,
    NS: gl.constexpr,
    WIDTH: gl.constexpr,
):
    """Step k's wgmma (async) on the decoded bytes, once its activation tile is in: the tile's first rows,
    as many as the accumulator's columns."""
    a_smem, ready = ring[1], ring[2]
    s = k % NS
    mbarrier.wait(ready.index(s), (k // NS) & 1)
    a = _fragment(decoded[0], decoded[1], fragment)
    tile = a_smem.index(s)
    if WIDTH < tile.shape[0]:
        tile = tile.slice(0, WIDTH)
    return warpgroup_mma(a, tile.permute((1, 0)), acc, use_acc=USE_ACC, is_async=True)


@gluon.jit
def _factors(weights, r):
    """Reference r's 2^(s_ref - 133) of each row (fp32, the mma layout's rows)."""
    return gl.load(weights[3] + r).to(gl.float32, bitcast=True)


@gluon.jit
def _kloop(
    ring,
    weights,
    zero,
    step0,
    fragment: gl.constexpr,
    KT: gl.constexpr,
    NS: gl.constexpr,
    DECODE_UNDER_MMA: gl.constexpr,
):
    """The tile's K-loop; its steps are the ring's steps step0 + 0 .. KT - 1. The next pair's decode runs
    under the pair's two wgmmas (DECODE_UNDER_MMA; ptxas then waits for each wgmma instruction before the
    next, C7513: registers of an open wgmma pipeline stage are redefined), or after their wait, the pair's
    wgmma instructions issued back to back and the decode under the other math partition's."""
    shift = weights[2]
    empty = ring[3]
    WIDTH: gl.constexpr = zero.shape[1]
    acc = zero
    first = _decode(_step(weights, 0, KT), shift)
    second = _decode(_step(weights, 1, KT), shift)
    next0 = _step(weights, 2, KT)
    next1 = _step(weights, 3, KT)
    for i in range(KT // 2):
        k = 2 * i
        product = _issue(ring, first, step0 + k, zero, False, fragment, NS, WIDTH)
        product = _issue(ring, second, step0 + k + 1, product, True, fragment, NS, WIDTH)
        factors = _factors(weights, i)
        if DECODE_UNDER_MMA:
            first = _decode(next0, shift)  # steps k + 2 and k + 3 (clamped), under both wgmmas
            second = _decode(next1, shift)
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        else:
            product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
            first = _decode(next0, shift)
            second = _decode(next1, shift)
        next0 = _step(weights, k + 4, KT)
        next1 = _step(weights, k + 5, KT)
        mbarrier.arrive(empty.index((step0 + k) % NS), count=1)
        mbarrier.arrive(empty.index((step0 + k + 1) % NS), count=1)
        acc = acc + product * factors[:, None]
    if KT % 2 == 1:  # decoded above as step KT - 1, against its own reference
        product = _issue(ring, first, step0 + KT - 1, zero, False, fragment, NS, WIDTH)
        factors = _factors(weights, KT // 2)
        product = warpgroup_mma_wait(num_outstanding=0, deps=(product,))
        mbarrier.arrive(empty.index((step0 + KT - 1) % NS), count=1)
        acc = acc + product * factors[:, None]
    return acc


@gluon.jit
def _math(
    ring,
    tensors,
    ints,
    half,
    KT: gl.constexpr,
    BN: gl.constexpr,
    NS: gl.constexpr,
    N_ROWS: gl.constexpr,
    N_OUT: gl.constexpr,
    GATED: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    GROUP_M: gl.constexpr,
    NARROW: gl.constexpr,
    DECODE_UNDER_MMA: gl.constexpr,
):
    """The program's tiles (every num_programs-th from its id), weight rows 64 `half` onward of each. With
    NARROW, `_tile` on as many of an M-block's rows as hold pairs, rounded up to BN / 4, BN / 2 or BN: an
    expert's padding rows close its last block, so a block holds at most BN / 4 pairs when its row BN / 4
    is padding. A narrower wgmma does the MMA work of the rows it covers; the decode is the same. Without
    NARROW, `_tile` on all BN rows."""
    sorted_pairs_ptr, block_expert_ptr = tensors[5], tensors[7]
    num_blocks_ptr, num_pairs, stride_d, stride_out = ints
    NUM_PID_N: gl.constexpr = N_ROWS // 128
    valid_m = gl.load(num_blocks_ptr)
    step0 = 0
    for tile in range(gl.program_id(0), valid_m * NUM_PID_N, gl.num_programs(0)):
        pid_m, pid_n = _tile_of(tile, valid_m, NUM_PID_N, GROUP_M)
        expert = gl.load(block_expert_ptr + pid_m).to(gl.int64)
        args = (
            ring,
            tensors,
            (expert, pid_m, num_pairs, stride_d, stride_out),
            pid_n * 128 + 64 * half,
            step0,
        )
        # NARROW is a constexpr: without it the first two branches are not compiled at all.
        if NARROW and gl.load(sorted_pairs_ptr + pid_m * BN + BN // 4) >= num_pairs:
            _tile(*args, KT, BN, BN // 4, NS, N_ROWS, N_OUT, GATED, INTERLEAVED, ACTIVATION, ALPHA, HAS_LIMIT,
                  LIMIT, DECODE_UNDER_MMA)  # fmt: skip
        elif NARROW and gl.load(sorted_pairs_ptr + pid_m * BN + BN // 2) >= num_pairs:
            _tile(*args, KT, BN, BN // 2, NS, N_ROWS, N_OUT, GATED, INTERLEAVED, ACTIVATION, ALPHA, HAS_LIMIT,
                  LIMIT, DECODE_UNDER_MMA)  # fmt: skip
        else:
            _tile(*args, KT, BN, BN, NS, N_ROWS, N_OUT, GATED, INTERLEAVED, ACTIVATION, ALPHA, HAS_LIMIT,
                  LIMIT, DECODE_UNDER_MMA)  # fmt: skip
        step0 += KT


@gluon.jit
def _tile(
    ring,
    tensors,
    ints,
    wrow0,
    step0,
    KT: gl.constexpr,
    BN: gl.constexpr,
    WIDTH: gl.constexpr,  # the block's first WIDTH rows (the wgmma's N)
    NS: gl.constexpr,
    N_ROWS: gl.constexpr,
    N_OUT: gl.constexpr,
    GATED: gl.constexpr,
    INTERLEAVED: gl.constexpr,
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    DECODE_UNDER_MMA: gl.constexpr,
):
    """64 weight rows from `wrow0` (tile rows of the expert's packed weights) against the M-block's first
    WIDTH rows, then the epilogue. `tensors`: words, drops, activation scales, bias (or None), router
    weights, sorted pairs, out; `ints`: expert, M-block, pair count, the drops' and out's row strides."""
    w_ptr, d_ptr, a_scale_ptr, b_ptr, route_w_ptr, sorted_pairs_ptr, out_ptr = tensors[:7]
    expert, pid_m, num_pairs, stride_d, stride_out = ints
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [4, 1, 1], [2, 1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, WIDTH, 32]
    )
    fragment: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    rb = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, L3)))[:, None, None]
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, L3)))[None, :, None]
    slot = gl.arange(0, WORDS, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))[None, None, :]
    w_base = w_ptr + expert * (N_ROWS // 16 * KT * 32 * WORDS)
    d_base = d_ptr + expert * N_ROWS * stride_d
    w_steps = w_base + ((wrow0 // 16 + rb) * KT * 32 + lane) * WORDS + slot  # + t * 32 * WORDS
    d_steps = d_base + (wrow0 + 16 * rb + lane // 4 + 8 * (slot % 2)) * stride_d  # + t
    mma_rows = wrow0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma))
    weights = (w_steps, d_steps, 8 * (slot // 2), d_base + mma_rows * stride_d + KT)
    acc = _kloop(
        ring, weights, gl.zeros([64, WIDTH], gl.float32, mma), step0, fragment, KT, NS, DECODE_UNDER_MMA
    )
    slots = pid_m * BN + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, mma))
    acc = acc * gl.load(a_scale_ptr + slots)[None, :]
    if GATED:
        # Packed rows 2j / 2j + 1 are gate / up of column j (`mxfp4_w4a8` packs w13 interleaved); b13 is in
        # the checkpoint's gate layout.
        EL: gl.constexpr = gl.BlockedLayout([2, 4], [4, 8], [4, 1], [0, 1])
        acc = gl.convert_layout(acc, EL)
        if b_ptr is not None:
            r = wrow0 + gl.arange(0, 64, layout=gl.SliceLayout(1, EL))
            if not INTERLEAVED:
                r = r // 2 + (r % 2) * (N_OUT // 2)
            acc = acc + gl.load(b_ptr + expert * N_OUT + r).to(gl.float32)[:, None]
        gate, up = gl.split(gl.permute(gl.reshape(acc, [32, 2, WIDTH]), [0, 2, 1]))
        h = _gated_activation(gate, up, ACTIVATION, ALPHA, HAS_LIMIT, LIMIT)
        SL: gl.constexpr = gl.BlockedLayout([4, 1], [8, 4], [1, 4], [0, 1])
        h = gl.convert_layout(h, SL)
        cols = wrow0 // 2 + gl.arange(0, 32, layout=gl.SliceLayout(1, SL))
        rows = (pid_m * BN + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, SL))).to(gl.int64)
        gl.store(out_ptr + rows[None, :] * stride_out + cols[:, None], h)
    else:
        SL: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
        acc = gl.convert_layout(acc, SL)
        cols = wrow0 + gl.arange(0, 64, layout=gl.SliceLayout(1, SL))
        col_in = cols < N_OUT
        if b_ptr is not None:  # b2 per expert before the router weight, as GPT-OSS adds it
            b = gl.load(b_ptr + expert * N_OUT + cols, mask=col_in, other=0.0)
            acc = acc + b.to(gl.float32)[:, None]
        pairs = gl.load(sorted_pairs_ptr + pid_m * BN + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, SL)))
        valid = pairs < num_pairs
        acc = acc * gl.load(route_w_ptr + pairs, mask=valid, other=0.0)[None, :]
        y = acc.to(out_ptr.dtype.element_ty)
        mask = valid[None, :] & col_in[:, None]
        gl.store(out_ptr + pairs.to(gl.int64)[None, :] * stride_out + cols[:, None], y, mask=mask)


@gluon.jit
def _producer(
    ring,
    num_blocks_ptr,
    KT: gl.constexpr,
    NS: gl.constexpr,
    BN: gl.constexpr,
    NUM_PID_N: gl.constexpr,
    GROUP_M: gl.constexpr,
):
    """The activation tiles of the program's tiles through the ring, each stage once both math partitions
    handed it back."""
    a_desc, a_smem, ready, empty = ring
    valid_m = gl.load(num_blocks_ptr)
    step0 = 0
    for tile in range(gl.program_id(0), valid_m * NUM_PID_N, gl.num_programs(0)):
        row0 = _tile_of(tile, valid_m, NUM_PID_N, GROUP_M)[0] * BN
        for t in range(KT):
            g = step0 + t
            s = g % NS
            mbarrier.wait(empty.index(s), ((g // NS) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, t * STEP_K], ready.index(s), a_smem.index(s))
        step0 += KT


@gluon.jit
def _w4a8_gemm(
    a_desc,  # TMA: fp8 [R, K] activation rows in sorted order, [BN, 128] tiles
    a_scale_ptr,  # fp32 [R]
    w_ptr,  # int32 words [E, N_ROWS / 16, KT, 32, 8]
    d_ptr,  # int32 drops [E, N_ROWS, KT + R]
    b_ptr,  # bias [E, N] or None
    route_w_ptr,  # fp32 [T*K] (GEMM2)
    sorted_pairs_ptr,  # int32 [max_blocks * BN]
    block_expert_ptr,  # int32 [max_blocks]
    num_blocks_ptr,  # int32 [1]
    out_ptr,  # GATED: fp32 h [R, N_ROWS / 2], sorted rows; else y [T*K, N], pair order
    num_pairs,
    stride_d,
    stride_out,
    KT: gl.constexpr,
    N_ROWS: gl.constexpr,  # the packed weights' rows (a multiple of 128)
    N_OUT: gl.constexpr,  # the layer's rows (2I, or H for GEMM2's y: the first N_OUT of N_ROWS)
    BN: gl.constexpr,
    NS: gl.constexpr,
    GROUP_M: gl.constexpr,
    GATED: gl.constexpr,
    INTERLEAVED: gl.constexpr,  # the checkpoint's gate layout (b13's row order)
    ACTIVATION: gl.constexpr,
    ALPHA: gl.constexpr,
    HAS_LIMIT: gl.constexpr,
    LIMIT: gl.constexpr,
    MATH_REGISTERS: gl.constexpr,
    LOAD_REGISTERS: gl.constexpr,
    NARROW: gl.constexpr,  # blocks at most a quarter or half full run a narrower wgmma (`_math`)
    DECODE_UNDER_MMA: gl.constexpr,  # the next pair's decode under the pair's wgmmas (`_kloop`)
):
    """Persistent over the tiles (M-block, N-tile) of the valid M-blocks when launched with fewer programs."""
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [NS, BN, STEP_K], a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both math partitions
    ring = (a_desc, a_smem, ready, empty)
    tensors = (w_ptr, d_ptr, a_scale_ptr, b_ptr, route_w_ptr, sorted_pairs_ptr, out_ptr, block_expert_ptr)
    ints = (num_blocks_ptr, num_pairs, stride_d, stride_out)
    gl.warp_specialize(
        [
            (
                _math,
                (
                    ring,
                    tensors,
                    ints,
                    0,
                    KT,
                    BN,
                    NS,
                    N_ROWS,
                    N_OUT,
                    GATED,
                    INTERLEAVED,
                    ACTIVATION,
                    ALPHA,
                    HAS_LIMIT,
                    LIMIT,
                    GROUP_M,
                    NARROW,
                    DECODE_UNDER_MMA,
                ),
            ),
            (
                _math,
                (
                    ring,
                    tensors,
                    ints,
                    1,
                    KT,
                    BN,
                    NS,
                    N_ROWS,
                    N_OUT,
                    GATED,
                    INTERLEAVED,
                    ACTIVATION,
                    ALPHA,
                    HAS_LIMIT,
                    LIMIT,
                    GROUP_M,
                    NARROW,
                    DECODE_UNDER_MMA,
                ),
            ),
            (_producer, (ring, num_blocks_ptr, KT, NS, BN, N_ROWS // 128, GROUP_M)),
        ],
        [MATH_WARPS, 1],
        [MATH_REGISTERS, LOAD_REGISTERS],
    )

"""The WGMMA_BF16 engine's Gluon GEMMs: 16-bit float prefill, GEMM2 a persistent Gluon wgmma, GEMM1 on
tl.dot or (`gemm1_gluon`) Gluon.

Data flow (the rest of the layer is the tl.dot path's, `launch.py`):
  ids -> `align_routing` (always aligned: the engine is for prefill) -> `gemm2_blocks` (the alignment's
  128-row blocks at block_m 128, or `paired_blocks` over an alignment at 64 rows)
  -> GEMM1 writes h [R, I] in the alignment's sorted rows: `_moe_gemm1` (tl.dot, H_SORTED), or
     `_bf16_gemm1` over GEMM2's blocks (x rows gathered by cp.async, w13's gate and up rows by TMA)
  -> `_bf16_gemm2` over the same blocks, TMA reading h and w2 -> y [T*K, H] at pair rows, bias and
     router weight applied
  -> `sum_k` as on the tl.dot path.
Which specs and configs it takes is `wgmma_bf16_reason` and `TritonMoEConfig`'s engine rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moekit.errors import LayoutMismatchError
from moekit.kernels.triton.align import AlignedRouting, BlockList, cdiv, paired_blocks
from moekit.kernels.triton.wgmma_fp8 import LOAD_REGISTERS, MATH_REGISTERS, multiprocessors
from moekit.spec import GateLayout, MoESpec, WeightFormat

GEMM2_ROWS = 128  # two math warpgroups of 64 rows
TILE_K = 64  # both GEMMs' K-step: 128 bytes of a 16-bit row, one 128-byte swizzled TMA box
GEMM2_BLOCK_NS = (128, 256)  # y columns a tile: one wgmma N per warpgroup
# Ring depth by tile width, the deepest that fits sm_90's 227 KiB with the epilogue's re-layout scratch
# (compiled offline: 176 KiB at 128 columns, 208 KiB at 256).
_GEMM2_STAGES = {128: 5, 256: 4}
# The Gluon GEMM1's tile: 128 sorted rows x 128 columns of h (gate and up boxes of 128 w13 rows), four
# 48 KiB stages (213 KiB with the epilogue's re-layout, compiled offline for sm_90).
GEMM1_BLOCK_N = 128
GEMM1_STAGES = 4
# setmaxnreg budgets of the Gluon GEMM1: each math warpgroup holds a gate and an up accumulator (2 x 64
# fp32 a thread); the 4-warp producer holds the x rows' addresses. 2 x 128 x 216 + 128 x 80 = 65,536.
GEMM1_MATH_REGISTERS = 216
GEMM1_LOAD_REGISTERS = 80
# The alignments GEMM2's 128-row blocks can walk: its own blocks, or `paired_blocks` over 64-row ones.
ALIGNMENT_ROWS = (64, 128)


@dataclass(frozen=True)
class _Gluon:
    """The Gluon pieces the launch needs, imported once."""

    gl: object  # triton.experimental.gluon.language
    tensor_descriptor: type  # host-side TMA descriptor
    gemm1: object  # `_details.wgmma_bf16_gemm1._bf16_gemm1`
    gemm2: object  # `_details.wgmma_bf16_gemm2._bf16_gemm2`


@functools.cache
def _gluon_hopper() -> _Gluon | None:
    """The Gluon kernel and descriptor type, or None where this Triton has no Gluon Hopper support."""
    try:
        from moekit.kernels.triton._details import wgmma_bf16_gemm1, wgmma_bf16_gemm2
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return None
    return _Gluon(gl, TensorDescriptor, wgmma_bf16_gemm1._bf16_gemm1, wgmma_bf16_gemm2._bf16_gemm2)


def wgmma_bf16_reason(spec: MoESpec) -> str | None:
    """None if the WGMMA_BF16 engine computes `spec` (formats and shapes), else why not."""
    if spec.weight_format not in (WeightFormat.BF16, WeightFormat.FP16):
        return f"it takes bf16 or fp16 weights, got {spec.weight_format.value}"
    if spec.weight_format.float_dtype != spec.act_dtype:  # (float weights take no act_quant: `MoESpec`)
        return (
            f"its wgmma takes activations of the weights' dtype ({spec.weight_format.float_dtype}), got "
            f"{spec.act_dtype}"
        )
    if spec.I % 8:
        return f"TMA reads h and w2 rows in 16-byte units: I must be a multiple of 8, got {spec.I}"
    if _gluon_hopper() is None:
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return None


def gemm2_blocks(aligned: AlignedRouting) -> BlockList:
    """GEMM2's 128-row blocks over `aligned` (at 64 or 128 rows, `ALIGNMENT_ROWS`)."""
    if aligned.block_m == GEMM2_ROWS:
        return BlockList.of(aligned)
    return paired_blocks(aligned)


def gluon_gemm1_reason(spec: MoESpec) -> str | None:
    """None if the Gluon GEMM1 (`_details.wgmma_bf16_gemm1`) computes `spec`'s GEMM1, else why not (the
    engine then runs the tl.dot GEMM1). Both gate layouts: its gate and up boxes come through a TMA
    descriptor each (`_gate_up_descriptors`)."""
    if spec.H % TILE_K:
        return f"its x copies are whole 64-wide K-steps: H must be a multiple of 64, got {spec.H}"
    return None


def gluon_gemm1_runs(spec: MoESpec, x: torch.Tensor) -> bool:
    """Whether the Gluon GEMM1 runs for `spec` on `x` [T, H] (unit column stride): it computes the spec
    (`gluon_gemm1_reason`), and x's address is a multiple of 16 bytes and its row stride one of 16
    elements. The JIT tells the kernel a stride is 16-byte divisible only at multiples of 16 elements
    (and a pointer at addresses that are multiples of 16); below that cp.async cannot be 16 bytes wide.
    Otherwise the config's tl.dot GEMM1 runs."""
    return gluon_gemm1_reason(spec) is None and not x.stride(0) % 16 and not x.data_ptr() % 16


def wgmma_bf16_gemm1(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    route_w: torch.Tensor | None,
    aligned: AlignedRouting,
    blocks: BlockList,
    h: torch.Tensor,
    *,
    spec: MoESpec,
    group_m: int,
    activation: dict,
) -> None:
    """h[row] = act(x[token] @ w13[e]^T + b13[e]) (times the router weight `route_w` of INPUT placement)
    at `aligned`'s sorted rows over GEMM2's `blocks`, where `gluon_gemm1_runs`. `activation`: the tl.dot
    GEMM1's activation constexprs (ACTIVATION, ALPHA, HAS_LIMIT, LIMIT), the same names here."""
    num_pid_n = cdiv(spec.I, GEMM1_BLOCK_N)
    gate_desc, up_desc = _gate_up_descriptors(w13, spec.gate_layout)
    _gluon_hopper().gemm1[(blocks.max_blocks * num_pid_n,)](
        x_ptr=x,  # [T, H]
        gate_desc=gate_desc,
        up_desc=up_desc,
        b_ptr=b13,  # [E_local, 2I] or None
        route_w_ptr=route_w,  # fp32 [T*K] or None
        h_ptr=h,  # [R, I]
        sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [R]
        block_expert_ptr=blocks.block_expert,  # int32 [max_blocks]
        block_start_ptr=blocks.block_start,  # int32 [max_blocks] or None
        num_blocks_ptr=blocks.num_valid_blocks,  # int32 [1]
        expert_end_ptr=aligned.expert_offsets,  # int64 [E_local + 1]
        num_pairs=aligned.num_pairs,
        num_pid_m=blocks.max_blocks,
        stride_xm=x.stride(0),
        stride_hm=h.stride(0),
        stride_be=0 if b13 is None else b13.stride(0),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        TOP_K=spec.K,
        GROUP_M=group_m,
        NUM_STAGES=GEMM1_STAGES,
        HAS_BIAS=b13 is not None,
        ROUTE_ON_INPUT=route_w is not None,
        **activation,
        INTERLEAVED=spec.gate_layout is GateLayout.INTERLEAVED,
        MATH_REGISTERS=GEMM1_MATH_REGISTERS,
        LOAD_REGISTERS=GEMM1_LOAD_REGISTERS,
        num_warps=4,
    )


def _weight_rows(weights: torch.Tensor, what: str) -> torch.Tensor:
    """Expert weights [E, N, K] as the one [E*N, K] matrix TMA reads (a view: no copy a call)."""
    if not weights.is_contiguous() or weights.data_ptr() % 16:
        raise LayoutMismatchError(
            f"the WGMMA_BF16 engine reads {what} through TMA as one contiguous matrix of rows, got strides "
            f"{weights.stride()} (data {weights.data_ptr() % 16} bytes past a 16-byte boundary); call "
            f".contiguous() once at load time"
        )
    return weights.view(-1, weights.shape[-1])


def _gate_up_descriptors(w13: torch.Tensor, gate_layout: GateLayout):
    """TMA descriptors of w13's gate rows and of its up rows, in [GEMM1_BLOCK_N, 64] boxes. CONCAT: one
    descriptor over all [E*2I, H] rows, an expert's up rows I past its gate rows. INTERLEAVED: gate rows
    2j and up rows 2j+1 are each a matrix [E*I, H] of row stride 2H (views, no copy), so a box of
    either is GEMM1_BLOCK_N consecutive gate (or up) rows, as in the concatenated layout."""
    rows = _weight_rows(w13, "w13 [E, 2I, H]")  # [E_local * 2I, H]
    if gate_layout is GateLayout.CONCAT:
        both = _rows_descriptor(rows, GEMM1_BLOCK_N)
        return both, both
    gate_up = rows.view(-1, 2, rows.shape[-1])  # [E_local * I, (gate, up), H]
    return _rows_descriptor(gate_up[:, 0], GEMM1_BLOCK_N), _rows_descriptor(gate_up[:, 1], GEMM1_BLOCK_N)


def _rows_descriptor(tensor: torch.Tensor, rows: int):
    """A TMA descriptor of 16-bit `tensor` [R, C] (unit column stride; address and row stride multiples
    of 16 bytes) read in [rows, 64] boxes."""
    gluon = _gluon_hopper()
    gl_dtype = gluon.gl.bfloat16 if tensor.dtype == torch.bfloat16 else gluon.gl.float16
    block = [rows, TILE_K]
    layout = gluon.gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return gluon.tensor_descriptor.from_tensor(tensor, block, layout)


def wgmma_bf16_gemm2(
    h: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    route_w: torch.Tensor | None,
    aligned: AlignedRouting,
    blocks: BlockList,
    y: torch.Tensor,
    *,
    spec: MoESpec,
    block_n: int,
    group_m: int,
) -> None:
    """y[pair] = (h[row] @ w2[e]^T + b2[e]) * route_w[pair] for every kept pair (`route_w` None: the router
    weight was applied before GEMM1), over `blocks` (`gemm2_blocks`). `h` [R, I] (contiguous) is in
    `aligned`'s sorted rows; `y` [T*K, H] has contiguous rows. The caller checked the spec
    (`wgmma_bf16_reason`), the config and the device."""
    tiles = blocks.max_blocks * cdiv(spec.H, block_n)
    if tiles == 0:
        return
    _gluon_hopper().gemm2[(min(tiles, multiprocessors(h.device)),)](
        h_desc=_rows_descriptor(h, GEMM2_ROWS),  # [R, I]
        w_desc=_rows_descriptor(_weight_rows(w2, "w2 [E, H, I]"), block_n),  # [E_local * H, I]
        b_ptr=b2,  # [E_local, H] or None
        sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [R]
        route_w_ptr=route_w,  # fp32 [T*K] or None
        y_ptr=y,  # [T*K, H]
        block_expert_ptr=blocks.block_expert,  # int32 [max_blocks]
        block_start_ptr=blocks.block_start,  # int32 [max_blocks] or None
        num_blocks_ptr=blocks.num_valid_blocks,  # int32 [1]
        expert_end_ptr=aligned.expert_offsets,  # int64 [E_local + 1]
        num_pairs=aligned.num_pairs,
        stride_be=0 if b2 is None else b2.stride(0),
        stride_ym=y.stride(0),
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        GROUP_M=group_m,
        NUM_STAGES=_GEMM2_STAGES[block_n],
        HAS_BIAS=b2 is not None,
        ROUTE_ON_OUTPUT=route_w is not None,
        MATH_REGISTERS=MATH_REGISTERS,
        LOAD_REGISTERS=LOAD_REGISTERS,
        num_warps=4,
    )

"""FP8 quantization of activation rows on the device (W8A8's x and h): the host side of `_details.quant`.

Data flow: src [R, C] (bf16 / fp16 / fp32) [times a per-row factor] -> `_quant_fp8_rows` (one scale a row)
or `_quant_fp8_groups` (one scale per 1x128 group) -> float8_e4m3fn [R, C] + fp32 scales, the codes and
scales `moekit.formats` computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import triton
from moekit.kernels.triton._details.quant import _quant_fp8_groups, _quant_fp8_rows
from moekit.kernels.triton.pdl import pdl_args
from moekit.spec import ActivationQuant

if TYPE_CHECKING:
    from moekit.kernels.triton.align import AlignedRouting


def quantize_rows(
    src: torch.Tensor,
    *,
    quant: ActivationQuant,
    row_mult: torch.Tensor | None = None,
    pair_rows_of: AlignedRouting | None = None,
    row_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes [R, C] and fp32 scales [R, 1] / [R, ceil(C/128)] of `src`, exactly as moekit.formats.
    `pair_rows_of` (per token only; `src` in its sorted rows): only the rows that hold a pair are read;
    padding rows (those past the valid blocks included) keep no codes or scales (their readers mask
    them). At decode a block is mostly padding: gpt-oss-120b's W4A8 h at T = 64 spent 95 of 902 us
    quantizing every row of its 128-row blocks on an H200. `row_amax` (per token only, no `row_mult`):
    fp32 [R], each row's max |value| as the producer of `src` computed it, so the rows are read once."""
    rows, cols = src.shape
    per_group = quant is ActivationQuant.FP8_PER_GROUP_128
    if per_group and (pair_rows_of is not None or row_amax is not None):
        raise ValueError("quantize_rows: pair_rows_of and row_amax are for per-token scales (FP8_PER_TOKEN)")
    if row_amax is not None and row_mult is not None:
        raise ValueError("quantize_rows: row_amax is the maximum of src itself, so it takes no row_mult")
    groups = triton.cdiv(cols, 128) if per_group else 1
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=src.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=src.device)
    if per_group:  # a program quantizes up to 8 adjacent groups of a row (1024 values, 8 a thread)
        groups_per_program = min(8, triton.next_power_of_2(groups))
        _quant_fp8_groups[(rows, triton.cdiv(groups, groups_per_program))](
            **pdl_args(src.device),
            src_ptr=src,  # [R, C]
            row_mult_ptr=row_mult,  # fp32 [R] or None
            dst_ptr=data,  # fp8 [R, C]
            scale_ptr=scale,  # fp32 [R, G]
            stride_src=src.stride(0),
            stride_dst=data.stride(0),
            stride_scale=scale.stride(0),
            NUM_COLS=cols,
            HAS_ROW_MULT=row_mult is not None,
            GROUPS=groups_per_program,
        )
        return data, scale
    _quant_fp8_rows[(rows,)](
        **pdl_args(src.device),
        src_ptr=src,  # [R, C]
        row_mult_ptr=row_mult,  # fp32 [R] or None
        dst_ptr=data,  # fp8 [R, C]
        scale_ptr=scale,  # fp32 [R, 1]
        stride_src=src.stride(0),
        stride_dst=data.stride(0),
        stride_scale=scale.stride(0),
        NUM_COLS=cols,
        HAS_ROW_MULT=row_mult is not None,
        BLOCK=min(1024, triton.next_power_of_2(cols)),
        sorted_pairs_ptr=None if pair_rows_of is None else pair_rows_of.sorted_pair_ids,  # int32 [R]
        num_pairs=0 if pair_rows_of is None else pair_rows_of.num_pairs,
        row_amax_ptr=row_amax,  # fp32 [R] or None
    )
    return data, scale

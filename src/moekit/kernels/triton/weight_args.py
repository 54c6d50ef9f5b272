"""Pointers and strides of one expert matrix (w13 or w2) as the tl.dot GEMMs read it, checked once a call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moekit.errors import LayoutMismatchError
from moekit.formats.mxfp4_words import CHUNKS_PER_RUN


def stride_or_zero(t: torch.Tensor | None, dim: int) -> int:
    """`t.stride(dim)`, or 0 for an absent tensor (the kernel never reads through it)."""
    return 0 if t is None else t.stride(dim)


@dataclass(frozen=True)
class WeightArgs:
    """Pointers and strides of one expert matrix (w13 or w2) as the kernels read it."""

    data: torch.Tensor
    scale: torch.Tensor | None
    bias: torch.Tensor | None
    stride_we: int
    stride_wn: int
    stride_wse: int
    stride_wsn: int
    stride_wsk: int
    stride_be: int

    @classmethod
    def of(
        cls, data: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, *, name: str
    ) -> WeightArgs:
        if data.dim() == 6:  # MXFP4_MMA_WORDS [E, N/16, S, 8, 4, CHUNKS_PER_RUN]: contiguous runs
            run = CHUNKS_PER_RUN
            if data.stride()[3:] != (4 * run, run, 1) or (data.shape[2] > 1 and data.stride(2) != 32 * run):
                raise LayoutMismatchError(
                    f"MXFP4 words {name} must be contiguous in their last four dims, strides "
                    f"{data.stride()}; call .contiguous() once at load time"
                )
        elif data.dim() == 4:  # MXFP4 [E, N, G, 16]: the kernel walks a row's G*16 bytes as one run
            if data.stride(3) != 1 or data.stride(2) != 16:
                raise LayoutMismatchError(
                    f"MXFP4 {name} must be contiguous in its last two dims, strides "
                    f"{data.stride()}; call .contiguous() once at load time"
                )
        elif data.stride(2) != 1:
            raise LayoutMismatchError(
                f"{name} must be contiguous along its input dim, strides "
                f"{data.stride()}; call .contiguous() once at load time"
            )
        if bias is not None and bias.stride(1) != 1:
            raise LayoutMismatchError(f"the bias of {name} must be contiguous along its rows")
        sstrides = (*scale.stride(), 0, 0, 0)[:3] if scale is not None else (0, 0, 0)
        return cls(
            data=data,
            scale=scale,
            bias=bias,
            stride_we=data.stride(0),
            stride_wn=data.stride(1),
            stride_wse=sstrides[0],
            stride_wsn=sstrides[1],
            stride_wsk=sstrides[2],
            stride_be=stride_or_zero(bias, 0),
        )

    def kernel_args(self) -> dict:
        """The weight arguments both GEMM kernels take under the same names."""
        return dict(
            w_ptr=self.data,  # [E_local, N, K] float / fp8, MXFP4 uint8 [E_local, N, G, 16] or words
            w_scale_ptr=self.scale,  # per format, or None
            b_ptr=self.bias,  # [E_local, N] or None
            stride_we=self.stride_we,
            stride_wn=self.stride_wn,
            stride_wse=self.stride_wse,
            stride_wsn=self.stride_wsn,
            stride_wsk=self.stride_wsk,
            stride_be=self.stride_be,
        )

"""The MXFP4 decode GEMMs on Hopper: Gluon mma.sync over word-packed weights at a few tokens an expert, each
thread keeping 3 or 4 K-steps of weights in flight (`_details.words_decode`).

Data flow of one layer on this engine (`launch.triton_fused_moe` with MatmulEngine.MMA_WORDS_DECODE):
the tl.dot path's block lists and finish kernels, with both GEMMs' launches replaced by `decode_gemm`:
  x rows of each M-block's pairs x 64 w13 rows a program -> fp32 shares [S, T*K, 2I]
  -> `reduce._moe_gemm1_splits` (sum, b13, router weight on the input, activation) -> h [T*K, I]
  -> h rows x 64 w2 rows a program -> fp32 shares [S, T*K, H] -> `reduce._moe_sum_k` (sum, b2, router
     weight, top-k sum) -> out [T, H].
Which specs and configs it takes: `words_decode_reason`, `share_reason`; the planner offers it on sm_90.
"""

from __future__ import annotations

import functools

import torch

from moekit.formats.mxfp4_words import CHUNKS_PER_RUN, COLS_PER_CHUNK, ROWS_PER_BLOCK
from moekit.kernels.triton.wgmma_words import gluon_words_reason
from moekit.spec import MoESpec

NUM_WARPS = 4
ROWS = NUM_WARPS * ROWS_PER_BLOCK  # weight rows a program: 16 a warp (mma.sync m16n8k16 tiles)
K_STEP = CHUNKS_PER_RUN * COLS_PER_CHUNK  # columns of K a step: one stored run of the words
BLOCK_MS = (16, 32)  # pairs an aligned M-block (the MMA's N side; one pair a block runs N = 8)
DEPTHS = (3, 4)  # K-steps of weights in flight a thread (the config's num_stages)
# A program holds its share of the activation rows in shared memory (block_m rows x the share's K-steps,
# rounded up to whole rounds of the queue's depth): at most this much, so that two programs fit an SM.
MAX_SHARE_BYTES = 96 << 10


def share_bytes(in_dim: int, *, split_k: int, depth: int, n_tile: int) -> int:
    """Shared memory of a program's activation rows: n_tile rows x its share of the K-steps, whole rounds."""
    steps = -(-in_dim // K_STEP)
    share = -(-steps // split_k)
    return -(-share // depth) * depth * n_tile * K_STEP * 2


def gemm2_split(spec: MoESpec, split_k: int) -> int:
    """GEMM2's shares of K for GEMM1's `split_k`: as many programs an M-block as GEMM1 launches (its 2I / 64
    row tiles times split_k over GEMM2's H / 64), at most one a K-step and 16 in all."""
    tiles1, tiles2 = -(-2 * spec.I // ROWS), -(-spec.H // ROWS)
    return max(1, min(16, -(-spec.I // K_STEP), round(split_k * tiles1 / tiles2)))


def register_cap(n_tile: int, depth: int) -> int | None:
    """ptxas's register cap: 72 lets seven programs share an SM at one pair a block and a queue of 3 K-steps
    (compiled for sm_90: no spill in the K-loop); 16- and 32-pair blocks and a queue of 4 spill under it."""
    return 72 if n_tile == 8 and depth == 3 else None


def share_reason(spec: MoESpec, *, block_m: int, split_k: int, depth: int) -> str | None:
    """None if both GEMMs' shares of K fit a program's shared memory (`MAX_SHARE_BYTES`), else why not."""
    gemms = (("GEMM1 (K = H)", spec.H, split_k), ("GEMM2 (K = I)", spec.I, gemm2_split(spec, split_k)))
    for name, in_dim, split in gemms:
        size = share_bytes(in_dim, split_k=split, depth=depth, n_tile=block_m)
        if size > MAX_SHARE_BYTES:
            return (
                f"{name}: a program's share of the activations, {block_m} rows x {-(-in_dim // split)} "
                f"columns, takes {size} bytes of shared memory, over {MAX_SHARE_BYTES}; raise split_k"
            )
    return None


@functools.cache
def _kernel():
    """`_decode_gemm`, or None where this Triton has no Gluon Hopper support."""
    try:
        from moekit.kernels.triton._details import words_decode
    except ImportError:
        return None
    return words_decode._decode_gemm


def words_decode_reason(spec: MoESpec) -> str | None:
    """None if the decode kernel computes both GEMMs of `spec`, else why not. The weights must also be
    word-packed (MXFP4_MMA_WORDS), which their scale bytes decide at load time."""
    if (reason := gluon_words_reason(spec)) is not None:
        return reason
    if _kernel() is None:
        return "this Triton has no Gluon Hopper support (triton.experimental.gluon)"
    return None


def decode_gemm(
    a: torch.Tensor,
    *,
    a_row_div: int,
    words: torch.Tensor,
    scales: torch.Tensor,
    blocks,
    sorted_pairs: torch.Tensor | None,
    num_pairs: int,
    num_local_experts: int,
    split_k: int,
    depth: int,
    part: torch.Tensor,
) -> None:
    """part[s, p, :] = share s of A[p // a_row_div] @ W[e]^T for the pairs p of every M-block of `blocks`
    (an `align.BlockList`; e its expert): raw fp32 sums, every row of a held pair written. The caller
    checked `share_reason` (the config) and `words_decode_reason` (the spec).

    a: bf16 [rows, K], rows contiguous; words / scales: MXFP4_MMA_WORDS [E_local, N/16, S, 8, 4, 8] and
    uint8 [E_local, N, K/32] N-major; part: fp32 [split_k, num_pairs, N]."""
    n_rows, in_dim = scales.shape[1], scales.shape[2] * 32
    n_tile = 8 if sorted_pairs is None else blocks.block_m  # one pair a block: the MMA's narrowest N
    cap = register_cap(n_tile, depth)
    _kernel()[(blocks.max_blocks * -(-n_rows // ROWS), split_k)](
        a_ptr=a,
        w_ptr=words,
        s_ptr=scales,
        sorted_pairs_ptr=sorted_pairs,
        block_expert_ptr=blocks.block_expert,
        block_start_ptr=blocks.block_start,
        num_blocks_ptr=blocks.num_valid_blocks,
        part_ptr=part,
        num_pairs=num_pairs,
        num_local_experts=num_local_experts,
        stride_am=a.stride(0),
        stride_part_split=part.stride(0),
        stride_part_m=part.stride(1),
        IN_DIM=in_dim,
        N_ROWS=n_rows,
        A_ROW_DIV=a_row_div,
        BLOCK_M=blocks.block_m,
        N_TILE=n_tile,
        SPLIT_K=split_k,
        DEPTH=depth,
        num_warps=NUM_WARPS,
        **({} if cap is None else {"maxnreg": cap}),
    )

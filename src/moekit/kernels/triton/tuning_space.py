"""The configs worth sweeping for a spec and T: `default_config` first, then the tiles of its regime of
tokens per expert, and the engines that may pay there (`moekit.app.autotune` and
`benchmarks/sweep_configs.py` time them; tuned rows record the winners).

Data flow: (spec, T) -> `MoESpec.tokens_per_expert` -> the regime's tiles (16-row decode tiles up to 8
tokens an expert, growing M tiles beyond, FP8's and MXFP4's own prefill tiles and engines) -> the configs
that can serve the spec, the default first. The figures quoted were measured on an H200 unless a comment
says otherwise.
"""

from __future__ import annotations

from dataclasses import replace

from moekit.kernels.triton.config import (
    WGMMA_FP8_GEMM1_STAGES,
    WGMMA_FP8_TILES,
    WGMMA_WORDS_BLOCK_MS,
    MatmulEngine,
    TritonMoEConfig,
)
from moekit.kernels.triton.tuning import (
    MEASURED_SMS,
    WGMMA_BF16_GLUON,
    WGMMA_FP8_DEFAULT,
    WGMMA_MIN_TOKENS_PER_EXPERT,
    WGMMA_WORDS_DEFAULT,
    WORDS_DECODE_DEFAULT,
    default_config,
    gemm2_programs,
    w4a8_tiles,
    wgmma_w4a8_configs,
    wgmma_words_may_pay,
)
from moekit.kernels.triton.wgmma_bf16 import GEMM2_BLOCK_NS as WGMMA_BF16_GEMM2_BLOCK_NS
from moekit.kernels.triton.wgmma_bf16 import gluon_gemm1_reason, wgmma_bf16_reason
from moekit.kernels.triton.wgmma_w4a8 import wgmma_w4a8_reason
from moekit.spec import ActivationQuant, MoESpec, WeightFormat


def tuning_space(
    spec: MoESpec, num_tokens: int, multiprocessors: int | None = None, *, hopper: bool = False
) -> tuple[TritonMoEConfig, ...]:
    """`default_config` first, then tiles for the regime of tokens per expert, from H200 sweeps
    (benchmarks/sweep_configs.py): decode streams weights (16-row M tiles, deeper pipelines, both
    orientations for formats without MXFP4's register-side upcast), prefill grows the M tile.
    Configs that cannot serve the spec are dropped."""
    per_expert = spec.tokens_per_expert(num_tokens)
    mxfp4 = spec.weight_format is WeightFormat.MXFP4
    if mxfp4 and spec.act_quant is not ActivationQuant.NONE:
        if hopper and wgmma_w4a8_reason(spec) is None:
            return wgmma_w4a8_configs()
        return w4a8_tiles(per_expert)
    default = default_config(spec, num_tokens, multiprocessors, hopper=hopper)
    dot_default = default_config(spec, num_tokens, multiprocessors)  # split-K variants are tl.dot's
    # (block_m, block_n, block_k, group_m, num_warps, num_stages)
    if per_expert <= 8:
        tiles = [
            (16, 32, 128, 1, 4, 3),
            (16, 64, 64, 1, 4, 4),
            (16, 64, 64, 1, 4, 5),
            (16, 64, 64, 1, 8, 4),
            (16, 64, 128, 1, 4, 3),
            (16, 64, 128, 1, 4, 4),
            (16, 128, 64, 1, 8, 4),
            # Two warpgroups on wide, deep tiles, as triton_kernels decodes gpt-oss (its opt_flags:
            # block_n 256 rows of w13 = our 2 * 128, block_k 128, 8 warps).
            (16, 128, 128, 1, 8, 3),
            (16, 64, 128, 1, 8, 3),
        ]
        # Register caps (5 or 6 programs per SM instead of 4) and 4-stage 2-warpgroup tiles were 5 - 60 %
        # slower for gpt-oss on an H200 at every T <= 256: not swept.
    elif per_expert <= 32:
        tiles = [
            (16, 64, 64, 4, 4, 4),
            (32, 64, 64, 4, 4, 4),
            (32, 64, 64, 4, 8, 4),
            (32, 128, 64, 4, 8, 4),
            (64, 64, 64, 8, 4, 4),
            # 128-wide K-steps on 32-row tiles: vLLM's H200 table for Mixtral (E 8, N 14336) at 16 - 24
            # tokens an expert; on 64-row tiles, 8 warps, 4 stages and no M-grouping at 32 (T = 128), where
            # it ran 1 % ahead of moekit's best (H200, bench_vs_vllm.py).
            (32, 64, 128, 4, 4, 3),
            (64, 64, 128, 1, 8, 4),
        ]
        if mxfp4:  # one M-block per expert decodes each weight tile once, half-empty or not
            tiles += [
                (32, 64, 128, 4, 4, 3),
                (64, 64, 64, 8, 4, 3),
                (32, 64, 128, 4, 4, 4),
                (64, 64, 128, 8, 4, 3),
            ]
    elif per_expert <= 128:
        tiles = [
            (32, 64, 64, 8, 4, 4),
            (64, 64, 64, 8, 4, 4),
            (64, 64, 64, 8, 4, 3),
            (64, 128, 64, 8, 8, 4),
            (128, 64, 64, 8, 4, 4),
            (128, 128, 64, 8, 8, 3),  # the float prefill default, and one stage deeper
            (128, 128, 64, 8, 8, 4),
            # vLLM's H200 tile for Mixtral at 64 - 512 tokens an expert (M-groups of 16), 1.4 % ahead of
            # moekit's best at T = 512 (H200, bench_vs_vllm.py)
            (128, 128, 64, 16, 8, 4),
        ]
        if mxfp4:  # 64 rows of w13 a tile (see below)
            tiles += [(128, 32, 64, 8, 4, 3), (128, 32, 64, 8, 4, 4)]
    else:
        tiles = [
            (128, 64, 64, 8, 4, 4),
            (128, 64, 64, 8, 4, 3),
            (64, 64, 64, 8, 4, 4),
            (128, 128, 64, 8, 8, 4),
            (128, 128, 64, 8, 8, 3),
        ]
        # 128 x 128 on 4 warps (GEMM1's 128 x 256 accumulator in one warpgroup) ran 3.5 - 4.3x slower than
        # on 8 warps for bf16 Qwen3-30B (T = 4096, 16384) and Mixtral (T = 4096) on an H200: not swept.
        # 8-warp MXFP4 tiles (block_m 256, block_n / block_k 128) were 2 - 13 % slower at T >= 2048 on an
        # H200 (before the word path refused them, `reason_unusable`): not swept.
        if mxfp4:  # 64 rows of w13 a tile: a third the registers, three programs an SM instead of two
            tiles += [(128, 32, 64, 8, 4, 3), (128, 32, 64, 8, 4, 4), (256, 32, 64, 8, 4, 3)]
    # MXFP4 upcasts on the register side of the MMA whichever way round (Triton's dot_scaled), so
    # swapping only adds a transpose there; float and FP8 weights try it while M tiles are small.
    swaps = (False,) if mxfp4 or per_expert > 8 else (False, True)
    # GEMM2's tile is half GEMM1's (no gate/up pair): 4-warp tiles also try GEMM2 on 128 weight rows,
    # the size of GEMM1's operand, which halves the activation rows GEMM2 re-reads per weight row.
    gemm2_rows = {(64, 4): (None, 128), (32, 4): (64, 128)}
    if not spec.weight_format.is_quantized:
        # 8-warp float tiles: GEMM2 also on twice their rows (vLLM's H200 tiles for Mixtral: 128 x 256 for
        # prefill, 64 x 128 at 32 tokens an expert): half the programs, one wave fewer where few experts
        # leave GEMM2 about two waves.
        gemm2_rows.update({(128, 8): (None, 256), (64, 8): (None, 128)})
    grid = [
        TritonMoEConfig(
            block_m=m,
            block_n=n,
            block_k=k,
            group_m=g,
            num_warps=w,
            num_stages=st,
            swap_ab=swap,
            gemm2_block_n=n2,
        )
        for m, n, k, g, w, st in tiles
        for swap in swaps
        for n2 in gemm2_rows.get((n, w), (None,))
    ]
    if num_tokens * spec.K <= 32:
        # A decode step of few pairs hits at most that many experts: T = 1 of gpt-oss-120b runs 4 x 45
        # GEMM1 programs on 132 SMs. Split-K multiplies the programs (and weight bytes in flight).
        grid += [replace(dot_default, split_k=s, gemm2_block_n=n2) for s in (2, 3, 4) for n2 in (None, 128)]
    elif gemm2_programs(spec, num_tokens, dot_default) < 2 * (multiprocessors or MEASURED_SMS):
        # Few experts with long K (Mixtral-sized: 8 experts, I = 14336) leave GEMM2 under two programs an
        # SM beyond decode too (T = 512: 8 blocks x 32 N-tiles); split its K as decode does.
        grid += [replace(dot_default, split_k=s, tail_block_m=None) for s in (2, 4)]  # tails need whole K
    if spec.weight_format is WeightFormat.FP8_E4M3 and per_expert > 32:
        # Larger tiles for prefill: GEMM1 holds gate and up accumulators plus each K-step's product to
        # promote. Compiled for sm_90 offline (tools/sass_report.py --model deepseek --format w8a8), none
        # of these spills since a K-step's weight scales are one or two numbers (W_SCALE_BLOCKS): 128 x 64
        # (GEMM2 on 128 rows), 64 x 128 and 128 x 128 (255 registers) on 8 warps, at 3 or 4 stages; the
        # deeper rings (128 x 64 at 5, 64 x 128 at 4) are for long K-loops, where they may pay.
        grid += [
            TritonMoEConfig(
                block_m=m, block_n=n, block_k=128, group_m=8, num_warps=8, num_stages=st, gemm2_block_n=128
            )
            for m, n, st in (
                (128, 64, 3),
                (128, 64, 4),
                (128, 64, 5),
                (64, 128, 3),
                (64, 128, 4),
                (128, 128, 3),
            )
        ]
        # and the short-K-loop tile, 64 x 64 on 4 warps (the default where GEMM2's K-loop is short)
        grid.append(
            TritonMoEConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
        )
    if hopper and mxfp4 and wgmma_words_may_pay(spec, per_expert):
        # The WGMMA_WORDS engine at both pair tiles and depths, wherever it may pay (tuned rows choose).
        grid += [
            replace(WGMMA_WORDS_DEFAULT, block_m=m, num_stages=st)
            for m in WGMMA_WORDS_BLOCK_MS
            for st in (3, 4)
        ]
    if hopper and mxfp4 and num_tokens * spec.K <= 32:
        # The MMA_WORDS_DECODE engine at its splits and queue depths (specs it cannot compute and shares too
        # long for shared memory are refused: dropped below).
        grid += [
            replace(WORDS_DECODE_DEFAULT, split_k=s, num_stages=d) for s in (1, 2, 3, 4, 6) for d in (3, 4)
        ]
    if hopper and spec.weight_format is WeightFormat.FP8_E4M3 and per_expert > 32:
        # The WGMMA_FP8 engine's free knobs (it refuses specs it cannot compute: dropped below).
        # GEMM1 on 128-row blocks only from 64 tokens an expert: below, an expert's one odd 64-row block
        # idles half of each program (12 - 19 % slower on an H200).
        gemm1_rows = (
            (None, WGMMA_FP8_TILES["block_m"]) if per_expert >= WGMMA_MIN_TOKENS_PER_EXPERT else (None,)
        )
        # GEMM1's ring at its deepest and one stage less (shallower rings were slower at every T measured).
        grid += [
            replace(WGMMA_FP8_DEFAULT, group_m=g, num_stages=st, gemm1_block_m=rows)
            for g in (1, 8)
            for rows in gemm1_rows
            for st in WGMMA_FP8_GEMM1_STAGES[rows][-2:]
        ]
    if per_expert > 32:
        # Each expert's odd last half-block in a second launch (tail_block_m): 1 - 8 % faster for gpt-oss-120b
        # at T = 2048 - 16384 on an H200.
        grid += [
            replace(c, tail_block_m=c.block_m // 2)
            for c in grid
            if c.block_m >= 64 and c.split_k == 1 and c.engine is MatmulEngine.TL_DOT
        ]
    if hopper and per_expert > 32 and wgmma_bf16_reason(spec) is None:
        # The WGMMA_BF16 engine (a persistent Gluon GEMM2 on TMA loads) behind each prefill GEMM1 tiling
        # whose alignment its 128-row GEMM2 blocks can walk, at both GEMM2 widths.
        grid += [
            replace(c, engine=MatmulEngine.WGMMA_BF16, gemm2_block_n=n2)
            for c in grid
            if c.engine is MatmulEngine.TL_DOT
            for n2 in WGMMA_BF16_GEMM2_BLOCK_NS
            if replace(c, gemm2_block_n=n2).wgmma_bf16_walks_tiling
        ]
        if gluon_gemm1_reason(spec) is None:  # its tiles are fixed: the alignments and widths only
            grid += [
                replace(WGMMA_BF16_GLUON, gemm2_block_n=n2, **alignment)
                for n2 in WGMMA_BF16_GEMM2_BLOCK_NS
                for alignment in (dict(block_m=128), dict(block_m=128, tail_block_m=64))
            ]
    # Mid-range 64-row 4-warp MXFP4 word tiles hold 210 - 240 registers (two programs an SM); capped at
    # 168 (three an SM, no spill) they were 4 - 17 % slower for gpt-oss-120b at T = 1024 / 2048 and
    # gpt-oss-20b at T = 512 on an H200: not swept.
    # 64 weight rows x 256 tokens (wgmma m64n256; block_m 256, block_n 32, GEMM2 64) decodes half the weights
    # per FLOP of 128 x 128 but was 5 - 75 % slower for gpt-oss-120b at T = 2048 - 16384 on an H200:
    # not swept.
    unique = dict.fromkeys([default, *grid])
    return tuple(c for c in unique if c.reason_unusable(spec) is None)

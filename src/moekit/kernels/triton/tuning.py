"""How the Triton fused-MoE path is tiled when no tuned row decides: the regimes of tokens per expert.

Data flow: (spec, T) -> tokens per expert (T * K / E, the M rows each expert's GEMMs see on
average, `MoESpec.tokens_per_expert`) -> `default_config` (one config per regime and weight format;
`tuning_space` sweeps around it, and the tuned rows that `moekit.app.autotune` writes refine it per model
and T).
The figures quoted below were measured on an H200 (whole layer, graph replay, L2 flushed).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from moekit.kernels.triton.config import (
    MMA_WORDS_DECODE_TILES,
    MXFP4_PREFILL_TILES,
    WGMMA_FP8_GEMM1_STAGES,
    WGMMA_FP8_TILES,
    WGMMA_W4A8_TILES,
    WGMMA_WORDS_TILES,
    MatmulEngine,
    TritonMoEConfig,
)
from moekit.kernels.triton.wgmma_bf16 import gluon_gemm1_reason, wgmma_bf16_reason
from moekit.kernels.triton.wgmma_fp8 import per_channel, wgmma_fp8_reason
from moekit.kernels.triton.wgmma_w4a8 import wgmma_w4a8_reason
from moekit.kernels.triton.wgmma_words import wgmma_words_reason
from moekit.spec import ActivationQuant, MoESpec, WeightFormat


def _experts_hit(spec: MoESpec, num_tokens: int) -> int:
    """About how many of this layer's experts a decode step of `num_tokens` reaches (one M-block each):
    its T * K picks, E_local / E of them local, at most E_local."""
    local_pairs = max(num_tokens, 1) * spec.K * spec.E_local / spec.E
    return max(1, min(math.ceil(local_pairs), spec.E_local))


# Block-128 W8A8 from this many tokens an expert takes the WGMMA_FP8 engine on Hopper. On an H200 (whole
# layer, graph replay, L2 flushed) against the tl.dot tiles: -0.5 % at 32 tokens an expert (fewer rows an
# expert leave its 64-row blocks mostly padding), -0.3 to +6 % at 64 - 96, +4 to +9 % at 128 - 768, for
# DeepSeek-V3 (E 256, H 7168, I 2048) and held-out shapes (E 128 / 64, H 4096 / 2048, I 1536 / 1280).
WGMMA_MIN_TOKENS_PER_EXPERT = 64
# GEMM1 on 64-row blocks, its ring at the deepest that fits (`WGMMA_FP8_GEMM1_STAGES`): three stages
# ran 7 - 19 % slower than four at every T swept on an H200.
WGMMA_FP8_DEFAULT = TritonMoEConfig(
    **WGMMA_FP8_TILES, group_m=8, num_stages=WGMMA_FP8_GEMM1_STAGES[None][-1], engine=MatmulEngine.WGMMA_FP8
)
# From this many tokens an expert GEMM1 runs on the 128-row blocks (`gemm1_block_m`). On an H200 (GEMM1's
# kernel time, same inputs, outputs bit-identical) the 128-row GEMM1 against the 64-row one: +1 to +5 % at
# 64 tokens an expert, -3 % at 128, -9 to -13 % at 256 - 1024, for DeepSeek-V3 (E 256, H 7168, I 2048)
# and held-out shapes (E 128 / 64, H 4096 / 2048); below 64 up to +19 % (an expert's one odd 64-row
# block leaves half the program idle through both passes over K).
WGMMA_FP8_TALL_MIN_TOKENS_PER_EXPERT = 128
# Its ring at its own deepest, one stage deeper than the 64-row GEMM1's: on an H200 (GEMM1's kernel time,
# same inputs, outputs equal) 5 stages against 4 ran 1 - 5 % shorter for DeepSeek-V3 at T = 4096 / 8192 /
# 16384 and E 128 / H 4096 / I 1536 at T = 4096 / 16384.
_TALL_ROWS = WGMMA_FP8_TILES["block_m"]
WGMMA_FP8_TALL = replace(
    WGMMA_FP8_DEFAULT, gemm1_block_m=_TALL_ROWS, num_stages=WGMMA_FP8_GEMM1_STAGES[_TALL_ROWS][-1]
)

# Per-channel and per-tensor W8A8 (per-token activations) from this many tokens an expert takes the
# WGMMA_FP8 engine's per-channel form on Hopper. On an H100 (whole layer, graph replay, L2 flushed), against
# the tl.dot tiles the rules below choose, for Mixtral (E 8, K 2, H 4096, I 14336): level at 64 (T = 256:
# 600 against 604 µs; 581 for the tl.dot tile at 5 stages), 12 - 17 % faster at 256 - 4096 (T = 1024 /
# 4096 / 16384: 1088 / 3566 / 14082 against 1243 / 4313 / 16620 µs).
WGMMA_FP8_CHANNEL_MIN_TOKENS_PER_EXPERT = 64

# Per-channel and per-tensor W8A8 prefill with long K-loops (GEMM2's K is I): 128 x 64 tiles on 8 warps, four
# stages, GEMM2 on 128 rows. On an H100 (whole layer, graph replay, L2 flushed, FP8 per token) 12 % ahead
# of 64 x 64 on 4 warps for Mixtral (I 14336) at 256 tokens an expert (T = 1024) and 14 % at 1024
# (T = 4096); for Qwen3-30B (I 768: six K-steps in GEMM2) 5 % behind at 256 (T = 4096) and 1.5 % ahead at
# 1024 (T = 16384). Block-128 scales take it at every I (with the tail: the rule in `default_config`).
FP8_LONG_K_MIN_I = 1536
FP8_LONG_K_PREFILL_TILES = TritonMoEConfig(
    block_m=128, block_n=64, block_k=128, group_m=8, num_warps=8, num_stages=4, gemm2_block_n=128
)

# The tl.dot tiles of 16-bit float prefill (beyond 48 tokens an expert), and the same GEMM1 behind the
# WGMMA_BF16 engine's persistent GEMM2, 256 columns a tile, which Hopper takes from 128 tokens an expert.
# On an H200 (layer without routing, graph replay, L2 flushed, two interleaved rounds) its GEMM2 kernel ran
# 10 - 24 % faster than the tl.dot one and the layer 3 - 7 % faster for Qwen3-30B (T = 4096), Qwen3-235B
# (16384) and Mixtral (512, 16384); Qwen3-30B T = 16384 gained in one round of two, and E 512 / K 10 /
# I 512 at T = 8192 was level.
FLOAT_PREFILL_TILES = TritonMoEConfig(
    block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, gemm2_block_n=256
)
WGMMA_BF16_DEFAULT = replace(FLOAT_PREFILL_TILES, engine=MatmulEngine.WGMMA_BF16)
# The default takes the engine from the fewest tokens an expert it was measured at (Mixtral T = 512);
# between 48 and 128 only the tuning space offers it.
WGMMA_BF16_MIN_TOKENS_PER_EXPERT = 128
# From this many tokens an expert GEMM1 runs on Gluon too (`gemm1_gluon`). On an H200 (layer without
# routing, graph replay, L2 flushed, two interleaved rounds) against the tl.dot GEMM1 behind the same
# GEMM2: +4 % at 128 tokens an expert (Mixtral T = 512) and +5 % at 256 (Qwen3-30B T = 4096); -1.4 and
# +2.2 % at 512 (Qwen3-30B and Qwen3-235B T = 8192) and -4.3 % (Mixtral T = 2048); -2 to -5 % at 1024 -
# 4096 (Qwen3-30B, Qwen3-235B, Mixtral at T = 16384), its kernel 3.5 - 9 % faster there. gpt-oss-120b in
# bf16 (interleaved gate/up): +2 / +5 / +2.5 % at 64 / 128 / 256, -2 to -9 % at 512 (T = 16384).
WGMMA_BF16_GLUON_GEMM1_MIN_TOKENS_PER_EXPERT = 512
WGMMA_BF16_GLUON = replace(WGMMA_BF16_DEFAULT, gemm1_gluon=True)

# MXFP4 W4A16 takes the WGMMA_WORDS engine on Hopper from this many tokens an expert. On an H200, whole
# layer (graph replay, L2 flushed) against the tl.dot default, at 64 (two device calls each): +4 to +8 %
# for E 8 / K 2 / H 4096 / I 14336, E 64 / K 6 / H 2048 / I 1408, E 128 / K 8 / H 4096 / I 1536, E 256 /
# K 8 / H 7168 / I 2048 and gpt-oss-20b, +1 to +3 % for gpt-oss-120b; +7 to +10 % at 128 and +5 to +10 %
# at 256 - 2048. At 32 it lost 10 - 27 % (gpt-oss-120b, 128 or 64 pairs a program): an 8-warp program
# decodes 128 weight rows for a few tokens.
WGMMA_WORDS_MIN_TOKENS_PER_EXPERT = 64
# The shortest K (min(H, I)) it was measured ahead at (22 K-steps); shorter K-loops, where a program's fixed
# costs (the ring's fill, the first decode, the epilogue) weigh more, keep the tl.dot tiles until measured.
WGMMA_WORDS_MIN_K = 1408
# 256 pairs a program (wgmma N = 256) decode each weight tile for twice the tokens; with an expert's last
# block padded to 256 they pay from 1024 tokens an expert: whole layer +1 to +2 % against 128-pair tiles at
# 1024 - 2048 (E 128 / K 8 / H 4096 / I 1536, E 64 / K 6 / H 2048 / I 1408, gpt-oss-20b), and -6 % at 256
# - 512 (E 256 / K 8 / H 7168 / I 2048).
WGMMA_WORDS_WIDE_FROM = 1024


WGMMA_WORDS_DEFAULT = TritonMoEConfig(
    **WGMMA_WORDS_TILES, block_m=128, group_m=8, num_stages=4, engine=MatmulEngine.WGMMA_WORDS
)
WORDS_DECODE_DEFAULT = TritonMoEConfig(
    **MMA_WORDS_DECODE_TILES, block_m=16, split_k=2, num_stages=3, engine=MatmulEngine.MMA_WORDS_DECODE
)


def _wgmma_words(per_expert: float) -> TritonMoEConfig:
    """The WGMMA_WORDS engine's config for `per_expert` tokens an expert."""
    return (
        replace(WGMMA_WORDS_DEFAULT, block_m=256)
        if per_expert >= WGMMA_WORDS_WIDE_FROM
        else WGMMA_WORDS_DEFAULT
    )


# Streaming multiprocessors of the parts the thresholds below were measured on (H100 SXM, H200), assumed
# when the device does not say (`DeviceInfo.multiprocessors` is None).
MEASURED_SMS = 132


def _decode_split_k(spec: MoESpec, num_tokens: int, sms: int) -> int:
    """Shares of K per program for a decode step of 16-token, 128-row tiles (both GEMMs on 64 weight
    rows a program): a few (token, expert) pairs make about one M-block per hit expert, so the GEMM with
    fewer N-tiles (GEMM1's I / 64 or GEMM2's H / 64) may leave SMs idle. Split until it has two
    programs per SM, into at most 4 shares of at least two 128-wide K-steps each."""
    programs = _experts_hit(spec, num_tokens) * -(-min(spec.I, spec.H) // 64)
    most = max(1, min(4, spec.H // 256, spec.I // 256))
    split = 1
    while programs * split < 2 * sms and split < most:
        split += 1
    return split


def gemm2_programs(spec: MoESpec, num_tokens: int, config: TritonMoEConfig) -> int:
    """About how many programs GEMM2 launches with `config`: an M-block per block_m pairs of each hit
    expert, times its N-tiles of H."""
    per_expert = spec.tokens_per_expert(num_tokens)
    blocks = _experts_hit(spec, num_tokens) * math.ceil(per_expert / config.block_m)
    return blocks * -(-spec.H // config.block_n_gemm2)


def wgmma_words_may_pay(spec: MoESpec, per_expert: float) -> bool:
    """Whether the WGMMA_WORDS engine computes `spec` at enough tokens an expert to be worth a try on
    Hopper: the tuning space offers it there, whatever the K-loop's length."""
    return per_expert >= WGMMA_WORDS_MIN_TOKENS_PER_EXPERT and wgmma_words_reason(spec) is None


def _takes_wgmma_words(spec: MoESpec, per_expert: float) -> bool:
    """Whether MXFP4 prefill defaults to the WGMMA_WORDS engine on Hopper (the thresholds above)."""
    return wgmma_words_may_pay(spec, per_expert) and min(spec.H, spec.I) >= WGMMA_WORDS_MIN_K


def _mxfp4_config(spec: MoESpec, num_tokens: int, per_expert: float, sms: int) -> TritonMoEConfig:
    """MXFP4 tiles by tokens per expert, from H200 sweeps of five shapes (E 8 - 256, K 2 - 8, H and I
    768 - 14336), where every winner had 4 warps and these tiles, each within 10 % of the best.

    Up to 8 tokens an expert the layer streams weights and the decode sets the pace: 16-token tiles of
    128 w13 rows with 128-wide K-steps, GEMM2 on 128 rows; split along K when too few programs
    (`_decode_split_k`), GEMM2 then on 64 rows for twice its programs. Up to 48 tokens an expert,
    32-token tiles decode each weight tile for twice the tokens; beyond, 128-token tiles. Tail blocks
    (`tail_block_m`) are left to tuned rows: from -3 % to +2 % at 96 - 2048 tokens an expert, but
    22 % slower at 64 with E = 32 (each launch then holds half the experts, too few programs).
    """
    if per_expert <= 8:
        split = _decode_split_k(spec, num_tokens, sms)
        return TritonMoEConfig(
            block_m=16,
            block_n=64,
            block_k=128,
            group_m=1,
            num_warps=4,
            num_stages=3,
            gemm2_block_n=None if split > 1 else 128,
            split_k=split,
        )
    if per_expert <= 48:
        return TritonMoEConfig(
            block_m=32, block_n=64, block_k=128, group_m=4, num_warps=4, num_stages=3, gemm2_block_n=128
        )
    return MXFP4_PREFILL_TILES


def w4a8_tiles(per_expert: float) -> tuple[TritonMoEConfig, ...]:
    """W4A8 candidates, the default first. block_k 32 keeps one MX group a K-step (always exact);
    block_k 128 folds four groups into one FP8 step and promotes a quarter as often (exact unless a
    group sits 8 binades below its neighbours, `_details.mxfp4._mxfp4_tiles` with FOLD). Tiles grow with
    tokens per expert as W8A8's do. The W8A8 regimes' tiles as a start: on an H200 the fastest of them
    ran at 0.31 - 0.35x W4A16's speed for gpt-oss-120b at T = 1024 - 16384 (bench_w4a8.py --sweep); the
    decode, not the tile, sets the pace."""
    if per_expert <= 16:
        tiles = [(16, 64, 1, 4, 4), (16, 64, 1, 4, 5), (16, 128, 1, 4, 4), (32, 64, 4, 4, 4)]
    elif per_expert <= 96:
        tiles = [(64, 64, 8, 4, 4), (64, 128, 8, 4, 4), (64, 128, 8, 8, 5), (32, 64, 4, 4, 4)]
    else:
        tiles = [(128, 128, 8, 8, 4), (128, 64, 8, 4, 4), (128, 128, 8, 8, 5), (64, 128, 8, 4, 4)]
    return tuple(
        TritonMoEConfig(block_m=m, block_n=n, block_k=k, group_m=g, num_warps=w, num_stages=st)
        for k in (32, 128)
        for m, n, g, w, st in tiles
    )


def wgmma_w4a8_configs() -> tuple[TritonMoEConfig, ...]:
    """The WGMMA_W4A8 engine's candidates, the default first: its activation ring 5 deep, then 4, 6, and 5
    with M-blocks grouped 8 to an N-tile. On an H200 (whole layer, graph replay, L2 flushed, gpt-oss-120b
    and -20b at T = 4096 and 16384, the persistent kernel) 5 stages ran 1.2 - 2.2 % faster than 4, 3 stages
    8 - 14 % slower, and 4 with M-blocks grouped 8 0 - 6 % slower than 4 alone."""
    return tuple(
        TritonMoEConfig(
            engine=MatmulEngine.WGMMA_W4A8,
            block_m=128,
            num_stages=stages,
            group_m=group_m,
            **WGMMA_W4A8_TILES,
        )
        for stages, group_m in ((5, 1), (4, 1), (6, 1), (5, 8))
    )


def default_config(
    spec: MoESpec, num_tokens: int, multiprocessors: int | None = None, *, hopper: bool = False
) -> TritonMoEConfig:
    """A capable config without tuning: tiles grow with the tokens each expert sees on average.
    `hopper`: the device is sm_90, where block-128 W8A8 prefill takes the WGMMA_FP8 engine and MXFP4
    W4A16 prefill the WGMMA_WORDS engine (`_takes_wgmma_words`).

    Chosen from sweeps on an H200 (whole layer, graph replay, L2 flushed); the tuned rows of
    `moekit/planning/tables/h200.json` refine it per model and T.
    """
    per_expert = spec.tokens_per_expert(num_tokens)
    if spec.act_dtype == torch.float32 and spec.act_quant is ActivationQuant.NONE:
        # fp32 dots run on FMA units (exact-comparison path): small tiles keep registers in check.
        return TritonMoEConfig(block_m=16 if per_expert <= 16 else 32, block_n=32, block_k=32, num_stages=2)
    fmt = spec.weight_format
    if fmt is WeightFormat.MXFP4 and spec.act_quant is not ActivationQuant.NONE:
        if hopper and wgmma_w4a8_reason(spec) is None:
            return wgmma_w4a8_configs()[0]
        return w4a8_tiles(per_expert)[0]
    if fmt is WeightFormat.MXFP4:
        if hopper and _takes_wgmma_words(spec, per_expert):
            return _wgmma_words(per_expert)
        return _mxfp4_config(spec, num_tokens, per_expert, multiprocessors or MEASURED_SMS)
    # Float and FP8 weights decode nothing, so a decode step puts the weight rows on the MMA's M side
    # (swap_ab): 64 of them against 16 token columns, as the H200 sweeps of Qwen3-30B, Mixtral and
    # DeepSeek-V3 chose at 6 of their 8 token counts up to 8 tokens an expert.
    if fmt is WeightFormat.FP8_E4M3:
        # Wider N tiles spill: FP8 keeps a second fp32 tile per K-step (the per-tile promotion).
        if per_expert <= 8:
            return TritonMoEConfig(
                block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3, swap_ab=True
            )
        w8a8 = spec.act_quant is not ActivationQuant.NONE
        channel_engine = hopper and per_channel(spec) and wgmma_fp8_reason(spec) is None
        if channel_engine and per_expert >= WGMMA_FP8_CHANNEL_MIN_TOKENS_PER_EXPERT:
            return WGMMA_FP8_TALL  # the per-channel form runs GEMM1 on the 128-row blocks only
        if per_expert <= 16 and (spec.scales_per_128_of_k or w8a8):
            # 64-row tiles on two warpgroups, four stages, though most of each block is padding: on an
            # H200 (whole layer) 7 - 17 % ahead of 16 x 64 on 4 warps at 12 - 16 tokens an expert, for
            # DeepSeek-V3 (T = 384 / 512: 2124 / 2373 against 2430 / 2851 µs) and a held-out shape (E 128,
            # H 4096, I 1536, T = 256: 607 against 653); behind at 24 - 32 (the next rule's tile). Per-channel
            # W8A8 on an H100: 22 % ahead for Mixtral at 16 (T = 64: 558 against 714 µs; 32 x 64 on 4 warps
            # ran 540).
            return TritonMoEConfig(block_m=64, block_n=64, block_k=128, group_m=1, num_warps=8, num_stages=4)
        if per_expert <= 16:
            return TritonMoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
        if per_expert <= 32 or not (spec.scales_per_128_of_k or (w8a8 and spec.I >= FP8_LONG_K_MIN_I)):
            return TritonMoEConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
        if not spec.scales_per_128_of_k:
            return FP8_LONG_K_PREFILL_TILES
        if hopper and per_expert >= WGMMA_MIN_TOKENS_PER_EXPERT and wgmma_fp8_reason(spec) is None:
            return WGMMA_FP8_TALL if per_expert >= WGMMA_FP8_TALL_MIN_TOKENS_PER_EXPERT else WGMMA_FP8_DEFAULT
        # Prefill with per-128 scales: 128 x 64 tiles on 8 warps, four stages, GEMM2 on 128 rows, each
        # expert's odd half-block apart. On an H200 the fastest, or within 2.3 % of it, at 64 - 512 tokens
        # an expert for DeepSeek-V3 (E 256, H 7168, I 2048) and for a held-out shape (E 128, H 4096,
        # I 1536): 3 - 9 % ahead of 64 x 64 on 4 warps.
        return TritonMoEConfig(
            block_m=128,
            block_n=64,
            block_k=128,
            group_m=8,
            num_warps=8,
            num_stages=4,
            gemm2_block_n=128,
            tail_block_m=64,
        )
    if per_expert <= 8:
        return TritonMoEConfig(
            block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4, swap_ab=True
        )
    if per_expert <= 48:
        # Both float presets' winners at 16 and 32 tokens an expert. Up to 48 the weights are still
        # streamed once an expert (one 64-row M-block each) while 128-row tiles are mostly padding: on an
        # H200, 10 % faster than 128 x 128 for E 512 / K 10 / H 2048 / I 512 at 40 tokens an expert and
        # 8 % for E 64 / K 6 / H 2048 / I 1280 at 48; at 64 (E 128 / K 4 / H = I = 2880) 3 % slower.
        return TritonMoEConfig(
            block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4, gemm2_block_n=128
        )
    # Prefill: 128 x 128 on 8 warps, GEMM2 on 256 rows (half its programs): on an H200 1 - 6 % ahead of
    # GEMM2 on 128 rows at 60 - 768 tokens an expert for five shapes no tuned row covers (E 8 - 512,
    # K 2 - 10, H 2048 - 4096, I 512 - 7168).
    if hopper and per_expert >= WGMMA_BF16_MIN_TOKENS_PER_EXPERT and wgmma_bf16_reason(spec) is None:
        gluon = (
            per_expert >= WGMMA_BF16_GLUON_GEMM1_MIN_TOKENS_PER_EXPERT and gluon_gemm1_reason(spec) is None
        )
        return WGMMA_BF16_GLUON if gluon else WGMMA_BF16_DEFAULT
    return FLOAT_PREFILL_TILES

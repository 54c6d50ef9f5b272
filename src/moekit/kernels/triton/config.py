"""What the Triton fused-MoE path computes, and the config that tiles it.

Data flow: spec -> `triton_supports` (the capability data of `TRITON_CAPABILITIES`, with sm_90 for the
formats whose dots need Hopper) -> a `TritonMoEConfig` (checked on its own in `__post_init__`) ->
`TritonMoEConfig.reason_unusable(spec)` (the config against the spec: scale groups, FP8 K-steps, the
MXFP4 word path's warp count) -> the launch (`launch.py`), which asserts both again.
`words_reason` says whether a spec's shapes allow the MXFP4_MMA_WORDS packing (`kernel.py` packs).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, replace

import torch

from moekit.errors import SpecError
from moekit.formats.mxfp4_words import layer_rows_reason
from moekit.kernels.base import Capabilities, DeviceInfo, DeviceKind, KernelConfig
from moekit.kernels.triton.wgmma_bf16 import ALIGNMENT_ROWS as WGMMA_BF16_ALIGNMENT_ROWS
from moekit.kernels.triton.wgmma_bf16 import GEMM2_BLOCK_NS as WGMMA_BF16_GEMM2_BLOCK_NS
from moekit.kernels.triton.wgmma_bf16 import wgmma_bf16_reason
from moekit.kernels.triton.wgmma_fp8 import wgmma_fp8_config_reason, wgmma_fp8_reason
from moekit.kernels.triton.wgmma_w4a8 import BLOCK_M as W4A8_BLOCK_M
from moekit.kernels.triton.wgmma_w4a8 import STAGES as W4A8_STAGES
from moekit.kernels.triton.wgmma_w4a8 import wgmma_w4a8_reason
from moekit.kernels.triton.wgmma_words import BLOCK_MS as WGMMA_WORDS_BLOCK_MS
from moekit.kernels.triton.wgmma_words import wgmma_words_reason
from moekit.kernels.triton.words_decode import BLOCK_MS as MMA_WORDS_DECODE_BLOCK_MS
from moekit.kernels.triton.words_decode import DEPTHS as MMA_WORDS_DECODE_DEPTHS
from moekit.kernels.triton.words_decode import share_reason, words_decode_reason
from moekit.spec import (
    Activation,
    ActivationQuant,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)
from moekit.weights import WeightPacking

TRITON_CAPABILITIES = Capabilities(
    weight_formats=frozenset(WeightFormat),
    fp8_scales=frozenset(Fp8Scale),
    act_quants=frozenset(ActivationQuant),
    act_dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
    activations=frozenset(Activation),
    honours_alpha=True,
    honours_limit=True,
    gate_layouts=frozenset(GateLayout),
    bias=True,
    router_placements=frozenset(RouterWeightPlacement),
    expert_map=True,
    devices=frozenset({DeviceKind.CUDA}),
    packings=frozenset({WeightPacking.CHECKPOINT, WeightPacking.MXFP4_MMA_WORDS, WeightPacking.MXFP4_W4A8}),
    min_compute_capability=(8, 0),  # the float formats; `_SM90_FORMATS` need 9.0
    act_quant_weight_formats=frozenset({WeightFormat.FP8_E4M3, WeightFormat.MXFP4}),  # W8A8, W4A8
)
# FP8 dots need sm_90, and the MXFP4 path is validated on Hopper only: for these formats the one
# compute-capability rule (`Capabilities.min_compute_capability`) is checked at 9.0.
_SM90_FORMATS = frozenset({WeightFormat.FP8_E4M3, WeightFormat.MXFP4})
_SM90_CAPABILITIES = replace(TRITON_CAPABILITIES, min_compute_capability=(9, 0))


def triton_supports(spec: MoESpec, *, device: DeviceInfo | None = None) -> str | None:
    """None if the Triton path computes `spec` (on `device`, if given), else the reason it cannot."""
    reason = TRITON_CAPABILITIES.check(spec, device)
    if reason is None and spec.weight_format in _SM90_FORMATS:
        # Everything but the compute capability passed above: only sm_90 can refuse here.
        reason = _SM90_CAPABILITIES.check(spec, device)
        if reason is not None:
            return f"{spec.weight_format.name} {reason}"
    if reason is None and device is not None and device.kind is DeviceKind.CUDA and _is_w4a8(spec):
        # On CUDA, W4A8 runs the WGMMA_W4A8 engine only: the tl.dot W4A8 decode (about 18 instructions an
        # element) ran at 0.31 - 0.35x W4A16's speed for gpt-oss-120b at T = 1024 - 16384 on an H200
        # (benchmarks/bench_w4a8.py), and opt-in W4A8 exists to be faster than W4A16.
        engine_reason = wgmma_w4a8_reason(spec)
        if engine_reason is not None:
            return (
                f"W4A8 (MXFP4 weights, FP8 activations) runs on CUDA on the WGMMA_W4A8 engine only, which "
                f"cannot compute this spec: {engine_reason}; the engine takes act_quant=FP8_PER_TOKEN, or "
                f"drop act_quant for the W4A16 path"
            )
    return reason


def _is_w4a8(spec: MoESpec) -> bool:
    return spec.weight_format is WeightFormat.MXFP4 and spec.act_quant is not ActivationQuant.NONE


@functools.cache  # `reason_unusable` asks before every launch
def words_reason(spec: MoESpec) -> str | None:
    """None if `spec`'s shapes and activations allow MXFP4_MMA_WORDS, else why not. The weights'
    scale bytes must fit too (`mxfp4_words.scales_reason`), which only the data can tell."""
    if spec.act_dtype not in (torch.bfloat16, torch.float32):
        return f"the word decode writes bf16 or fp32 operands, activations are {spec.act_dtype}"
    if spec.act_quant is not ActivationQuant.NONE:
        return "W4A8 decodes the checkpoint bytes into FP8 operands, not words into bf16 ones"
    return layer_rows_reason(intermediate=spec.I, hidden=spec.H)


class MatmulEngine(enum.Enum):
    """How a config's GEMMs are written."""

    TL_DOT = "Triton tl.dot kernels (every spec)"
    # W8A8 with block-128 scales, or per-channel / per-tensor weights and per-token activations
    # (`wgmma_fp8.wgmma_fp8_reason`): Gluon wgmma with each K-step's promotion overlapped with the next
    # step's MMA, a TMA producer warp, GEMM1 on 64- or 128-row blocks (gemm1_block_m; per-channel on 128
    # only), a persistent GEMM2 on 128-row blocks.
    WGMMA_FP8 = "Gluon wgmma kernels with overlapped FP8 promotion (W8A8, sm_90)"
    # MXFP4 W4A16 with word-packed weights only (`wgmma_words.wgmma_words_reason`): Gluon wgmma, the weights
    # in register A decoded one K-step ahead under the MMA, 8 warps, 128 weight rows against block_m pairs.
    WGMMA_WORDS = "Gluon wgmma kernels with the MXFP4 decode under the MMA (W4A16 word path, sm_90)"
    # MXFP4 W4A16 decode on word-packed weights (`words_decode.words_decode_reason`): Gluon mma.sync on
    # 64 weight rows a program, num_stages K-steps of weights in flight a thread, no barrier in the loop;
    # both GEMMs write fp32 split-K shares that the tl.dot path's finish kernels complete.
    MMA_WORDS_DECODE = "Gluon mma.sync split-K kernels streaming MXFP4 words for decode (W4A16, sm_90)"
    # 16-bit float weights and activations (`wgmma_bf16.wgmma_bf16_reason`): GEMM1 (tl.dot, or Gluon with
    # gemm1_gluon) writing h in the alignment's sorted rows, then a persistent Gluon wgmma GEMM2 reading h
    # and w2 through TMA.
    WGMMA_BF16 = "persistent Gluon wgmma GEMM2, GEMM1 on tl.dot or Gluon (16-bit float prefill, sm_90)"
    # MXFP4 weights with per-token FP8 activations (`wgmma_w4a8.wgmma_w4a8_reason`) on MXFP4_W4A8 weights:
    # Gluon FP8 wgmma, the weights decoded by byte permutes into register A, two math warpgroups of 64
    # weight rows and a TMA producer of the sorted FP8 rows, 128 rows a block.
    WGMMA_W4A8 = "Gluon FP8 wgmma kernels on MXFP4 weights decoded into register A (W4A8, sm_90)"


# The one tiling the WGMMA_FP8 engine runs (its kernels fix the rest): GEMM2's 128-row blocks with
# 64-row tails, 128 x 128 weight tiles, one 128-deep scale group a K-step, 4-warp warpgroups.
WGMMA_FP8_TILES = dict(block_m=128, tail_block_m=64, block_n=128, block_k=128, num_warps=4, split_k=1)
# The WGMMA_FP8 engine's num_stages is GEMM1's ring depth (GEMM2 runs at its own, `wgmma_fp8.GEMM2_STAGES`),
# by gemm1_block_m: at least 2 (each math warpgroup holds two K-steps' wgmma before it hands a stage
# back; one stage would wait on itself), at most the deepest that fits sm_90's 232,448 bytes of shared
# memory (compiled offline: the 64-row GEMM1's 40 KiB stages 204,880 bytes at 4, 245,872 at 5; the
# 128-row GEMM1's 32 KiB stages 204,896 at 5, 237,672 at 6).
WGMMA_FP8_GEMM1_STAGES = {None: range(2, 5), 128: range(2, 6)}
# What the WGMMA_BF16 engine fixes: a tl.dot GEMM1 takes the tile fields (free), without split-K or swap_ab
# (the engine is for prefill); its alignment is at 64 or 128 rows (`wgmma_bf16.ALIGNMENT_ROWS`: block_m
# 64, or 128 with or without 64-row tails) and GEMM2's tile one of `wgmma_bf16.GEMM2_BLOCK_NS` wide.
WGMMA_BF16_TILES = dict(split_k=1, swap_ab=False)
# What the WGMMA_WORDS engine's kernels fix: 64 columns of h a GEMM1 program (128 w13 rows), 128 w2 rows a
# GEMM2 program, 64-wide K-steps, two warpgroups; block_m one of WGMMA_WORDS_BLOCK_MS, group_m and
# num_stages (3 - 8) free, and the register cap its own (`wgmma_words.register_cap`).
WGMMA_WORDS_TILES = dict(
    block_n=64, gemm2_block_n=128, block_k=64, num_warps=8, split_k=1, tail_block_m=None, swap_ab=False
)

# What the MMA_WORDS_DECODE engine's kernel fixes: 64 weight rows a program in both GEMMs (GEMM1: 64 w13
# rows, the gate and up rows of 32 columns of h when interleaved), 128-wide K-steps, 4 warps; block_m one
# of MMA_WORDS_DECODE_BLOCK_MS, num_stages (the K-steps of weights in flight) one of MMA_WORDS_DECODE_DEPTHS,
# split_k free within the shared memory the activation shares take (`words_decode.share_reason`).
MMA_WORDS_DECODE_TILES = dict(
    block_n=32, gemm2_block_n=64, block_k=128, num_warps=4, tail_block_m=None, swap_ab=False, group_m=1
)

# What the WGMMA_W4A8 engine's kernel fixes: 128 sorted rows a block against 128 weight rows (64 columns of
# h in GEMM1), 128-wide K-steps, two 4-warp math partitions; group_m and num_stages (the activation ring,
# `wgmma_w4a8.STAGES`) free.
WGMMA_W4A8_TILES = dict(
    block_n=64, gemm2_block_n=128, block_k=128, num_warps=4, split_k=1, tail_block_m=None, swap_ab=False
)

# The Gluon word engines' tilings: fixed fields, block_m values, num_stages values and what else is free
# (max_registers is None: their launches set the register cap).
_WORD_ENGINE_TILINGS = {
    MatmulEngine.WGMMA_W4A8: (WGMMA_W4A8_TILES, (W4A8_BLOCK_M,), W4A8_STAGES, "group_m free"),
    MatmulEngine.WGMMA_WORDS: (WGMMA_WORDS_TILES, WGMMA_WORDS_BLOCK_MS, range(3, 9), "group_m free"),
    MatmulEngine.MMA_WORDS_DECODE: (
        MMA_WORDS_DECODE_TILES,
        MMA_WORDS_DECODE_BLOCK_MS,
        MMA_WORDS_DECODE_DEPTHS,
        "num_stages is the K-steps of weights in flight; split_k free",
    ),
}


_POW2_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps")


def _check_int(name: str, value: object, valid, rule: str, *, optional: bool = False) -> None:
    """A TritonMoEConfig field that is an int obeying `rule` (`valid`), or None if `optional`."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not valid(value):
        allowed = f"None or {rule}" if optional else rule
        raise SpecError(f"TritonMoEConfig.{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class TritonMoEConfig(KernelConfig):
    """Tile sizes of both grouped GEMMs (GEMM1 loads 2 * block_n weight rows: gate and up).

    Both GEMMs share the M-blocks (block_m: one routing alignment per call), K-step, warps and stages;
    GEMM2 may take a different N tile (`gemm2_block_n`), since its full tile is half GEMM1's. With
    `tail_block_m` the alignment is at that half size and each GEMM runs twice: block_m blocks, then
    each expert's odd last half-block (`align.split_tail_blocks`).
    `split_k` > 1 splits each GEMM's reduction into that many shares, one program each, summed in a
    fixed order by a small second kernel (deterministic): more programs, and more bytes in flight,
    when few M-blocks leave most of the SMs idle (decode).
    """

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False  # compute W @ A^T: weight rows on the MMA's M side, tokens on its N side
    # ptxas register cap per thread (PTX .maxnreg); None lets ptxas choose. Fewer registers fit more
    # programs on an SM, which hides the latency of the MXFP4 decode at small T, at some extra moves.
    max_registers: int | None = None
    # GEMM2's weight rows per tile; None: block_n. With 4 warps, GEMM1's 2 * 64 rows and GEMM2's 128 rows
    # give both the same 128-row register operand (two m64 wgmma per warpgroup).
    gemm2_block_n: int | None = None
    split_k: int = 1
    # block_m // 2, or None: an expert's last `tail_block_m` pairs or fewer run as a block of that size in
    # a second launch of each GEMM instead of padding a full block_m block (half its MMA rows wasted).
    tail_block_m: int | None = None
    engine: MatmulEngine = MatmulEngine.TL_DOT
    # GEMM1's rows a program where they differ from the alignment's blocks: WGMMA_FP8 only, where 128 runs
    # GEMM1 on GEMM2's 128-row blocks (`_details.wgmma_fp8_gemm1_tall`: a fifth less L2 traffic a FLOP,
    # each program twice as long) and None on the 64-row blocks.
    gemm1_block_m: int | None = None
    # WGMMA_BF16 only: GEMM1 on Gluon wgmma as well (`_details.wgmma_bf16_gemm1`: 128 x 128 tiles, the x rows
    # gathered by a cp.async producer, the weights by TMA) instead of tl.dot. Where that kernel cannot run
    # (`wgmma_bf16.gluon_gemm1_reason`, or x not 16-byte aligned) the tl.dot GEMM1 of the tile fields runs.
    gemm1_gluon: bool = False

    @property
    def alignment_rows(self) -> int:
        """The rows the alignment pads each expert's pairs to: tail_block_m where set (the blocks of
        twice as many rows are pairs of them), else block_m."""
        return self.tail_block_m or self.block_m

    @property
    def wgmma_bf16_walks_tiling(self) -> bool:
        """Whether the WGMMA_BF16 engine can run this tiling (whatever `engine` says): its fixed fields
        (`WGMMA_BF16_TILES`), an alignment its GEMM2 blocks walk, a GEMM2 tile of a width it has."""
        return (
            all(getattr(self, name) == value for name, value in WGMMA_BF16_TILES.items())
            and self.alignment_rows in WGMMA_BF16_ALIGNMENT_ROWS
            and self.block_n_gemm2 in WGMMA_BF16_GEMM2_BLOCK_NS
        )

    @property
    def block_n_gemm2(self) -> int:
        """The N tile GEMM2 runs with."""
        return self.block_n if self.gemm2_block_n is None else self.gemm2_block_n

    def __post_init__(self) -> None:
        for name in (*_POW2_FIELDS, "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"TritonMoEConfig.{name} must be a positive int, got {value!r}")
        for name in _POW2_FIELDS:
            value = getattr(self, name)
            if value & (value - 1):
                raise SpecError(f"TritonMoEConfig.{name} must be a power of two, got {value}")
        for name in ("block_m", "block_n", "block_k"):  # tl.dot's smallest tile edge
            if getattr(self, name) < 16:
                raise SpecError(f"TritonMoEConfig.{name} must be >= 16, got {getattr(self, name)}")
        if not isinstance(self.swap_ab, bool):
            raise SpecError(f"TritonMoEConfig.swap_ab must be a bool, got {self.swap_ab!r}")
        if self.num_warps > 16 or self.num_stages > 8:
            raise SpecError(f"num_warps <= 16 and num_stages <= 8, got {self.num_warps}, {self.num_stages}")
        _check_int(
            "gemm2_block_n",
            self.gemm2_block_n,
            lambda n: 16 <= n <= 256 and not n & (n - 1),
            "a power of two in [16, 256]",
            optional=True,
        )
        _check_int("split_k", self.split_k, lambda n: 1 <= n <= 16, "an int in [1, 16]")
        _check_int(
            "tail_block_m",
            self.tail_block_m,
            lambda m: m == self.block_m // 2 and m >= 16,
            f"block_m // 2 = {self.block_m // 2} (at least 16)",
            optional=True,
        )
        if self.tail_block_m is not None and self.split_k != 1:
            raise SpecError(
                f"TritonMoEConfig.tail_block_m needs split_k=1 (tail blocks are for large batches), got "
                f"split_k={self.split_k}; drop one of them"
            )
        if not isinstance(self.engine, MatmulEngine):
            raise SpecError(f"TritonMoEConfig.engine must be a MatmulEngine, got {self.engine!r}")
        if self.gemm1_block_m is not None and (
            self.engine is not MatmulEngine.WGMMA_FP8 or self.gemm1_block_m != self.block_m
        ):
            raise SpecError(
                f"TritonMoEConfig.gemm1_block_m is the WGMMA_FP8 engine's choice of GEMM1 on its 128-row "
                f"blocks: None, or {WGMMA_FP8_TILES['block_m']} with engine=WGMMA_FP8; got "
                f"gemm1_block_m={self.gemm1_block_m!r}, block_m={self.block_m}, engine={self.engine.name}"
            )
        if self.engine is MatmulEngine.WGMMA_FP8:
            fixed = {name: getattr(self, name) for name in WGMMA_FP8_TILES}
            if fixed != WGMMA_FP8_TILES or self.gemm2_block_n not in (None, 128) or self.swap_ab:
                raise SpecError(
                    f"the WGMMA_FP8 engine runs one tiling, {WGMMA_FP8_TILES} (gemm2_block_n None or "
                    f"128, no swap_ab; group_m, gemm1_block_m and GEMM1's ring depth num_stages free), "
                    f"got {fixed}, gemm2_block_n={self.gemm2_block_n}, swap_ab={self.swap_ab}"
                )
            depths = WGMMA_FP8_GEMM1_STAGES[self.gemm1_block_m]
            if self.num_stages not in depths:
                raise SpecError(
                    f"the WGMMA_FP8 engine's num_stages is GEMM1's ring depth: {depths.start} to "
                    f"{depths.stop - 1} with gemm1_block_m={self.gemm1_block_m} (two K-steps in flight, "
                    f"the ring in sm_90's shared memory), got {self.num_stages}"
                )
        if not isinstance(self.gemm1_gluon, bool) or (
            self.gemm1_gluon and self.engine is not MatmulEngine.WGMMA_BF16
        ):
            raise SpecError(
                f"TritonMoEConfig.gemm1_gluon is the WGMMA_BF16 engine's choice of a Gluon GEMM1: a bool, "
                f"True only with engine=WGMMA_BF16; got {self.gemm1_gluon!r} with engine={self.engine.name}"
            )
        if self.engine is MatmulEngine.WGMMA_BF16 and not self.wgmma_bf16_walks_tiling:
            fixed = {name: getattr(self, name) for name in WGMMA_BF16_TILES}
            raise SpecError(
                f"the WGMMA_BF16 engine runs {WGMMA_BF16_TILES}, an alignment (tail_block_m, else "
                f"block_m) of {WGMMA_BF16_ALIGNMENT_ROWS} rows and GEMM2 tiles (gemm2_block_n, else "
                f"block_n) {WGMMA_BF16_GEMM2_BLOCK_NS} wide; got {fixed}, alignment {self.alignment_rows}, "
                f"GEMM2 tile {self.block_n_gemm2}"
            )
        if self.engine in _WORD_ENGINE_TILINGS:
            tiles, block_ms, stages, free = _WORD_ENGINE_TILINGS[self.engine]
            fixed = {name: getattr(self, name) for name in tiles}
            if (
                fixed != tiles
                or self.block_m not in block_ms
                or self.num_stages not in stages
                or self.max_registers is not None
            ):
                raise SpecError(
                    f"the {self.engine.name} engine runs {tiles} with block_m in {block_ms}, num_stages in "
                    f"{tuple(stages)} and its own register cap (max_registers None; {free}), got {fixed}, "
                    f"block_m={self.block_m}, num_stages={self.num_stages}, "
                    f"max_registers={self.max_registers}"
                )
        _check_int(
            "max_registers",
            self.max_registers,
            lambda r: 32 <= r <= 255 and not r % 8,
            "a multiple of 8 in [32, 255] (ptxas' per-thread range)",
            optional=True,
        )

    def reason_unusable(self, spec: MoESpec) -> str | None:
        """None if this config can compute `spec`, else why not."""
        if self.engine is MatmulEngine.WGMMA_FP8:
            reason = wgmma_fp8_reason(spec) or wgmma_fp8_config_reason(spec, self.gemm1_block_m)
            return None if reason is None else f"the WGMMA_FP8 engine cannot compute this spec: {reason}"
        if self.engine is MatmulEngine.WGMMA_BF16:
            reason = wgmma_bf16_reason(spec)
            return None if reason is None else f"the WGMMA_BF16 engine cannot compute this spec: {reason}"
        if self.engine is MatmulEngine.WGMMA_W4A8:
            reason = wgmma_w4a8_reason(spec)
            return None if reason is None else f"the WGMMA_W4A8 engine cannot compute this spec: {reason}"
        if self.engine is MatmulEngine.WGMMA_WORDS:
            reason = wgmma_words_reason(spec)
            return None if reason is None else f"the WGMMA_WORDS engine cannot compute this spec: {reason}"
        if self.engine is MatmulEngine.MMA_WORDS_DECODE:
            reason = words_decode_reason(spec) or share_reason(
                spec, block_m=self.block_m, split_k=self.split_k, depth=self.num_stages
            )
            return None if reason is None else f"the MMA_WORDS_DECODE engine cannot run this spec: {reason}"
        if spec.weight_format is WeightFormat.MXFP4 and self.block_k % 32:
            return f"MXFP4 needs block_k to cover whole 32-element scale groups, got block_k={self.block_k}"
        if spec.weight_format is WeightFormat.MXFP4 and spec.act_quant is not ActivationQuant.NONE:
            if self.block_k not in (32, 64, 128):
                return (
                    f"W4A8 (MXFP4 weights, FP8 activations) promotes each K-step into fp32 (Hopper's FP8 "
                    f"sums are reduced-precision), so block_k must be 32, 64 or 128, got {self.block_k}"
                )
        if spec.scales_per_128_of_k and self.block_k > 128:
            return f"128-wide FP8 scale groups need block_k <= 128, got {self.block_k}"
        if spec.act_quant is not ActivationQuant.NONE and self.block_k < 32:
            return f"FP8 x FP8 dots need block_k >= 32, got {self.block_k}"
        if spec.act_quant is not ActivationQuant.NONE and self.block_k > 128:
            return (
                "FP8 x FP8 dots are promoted into fp32 every K-step (Hopper's FP8 sums are reduced-precision;"
                f" DeepSeek-V3 promotes every 128), so block_k must be at most 128, got {self.block_k}"
            )
        if spec.weight_format is WeightFormat.MXFP4 and self.num_warps > 4 and words_reason(spec) is None:
            # 8-warp tiles on the word path: on an H200, without the K-step wgmma wait
            # (`_details.matmul._wait_for_mma`) they gave rel L2 3e-3 on most runs and 1e32 or inf on
            # some; with the wait they were 11 - 58 % slower at every T, and no race hunt has cleared
            # them. Refused.
            return (
                f"the MXFP4 word path (MXFP4_MMA_WORDS, {spec.act_dtype} activations) is not verified with "
                f"{self.num_warps} warps (it gave intermittently wrong results before the K-step wgmma wait, "
                f"and was slower after it); use num_warps=4"
            )
        return None


# The tl.dot tiles of MXFP4 prefill (`tuning._mxfp4_config` beyond 48 tokens an expert), and what a
# WGMMA_WORDS plan runs on weights whose scale bytes kept CHECKPOINT packing (the engine reads words
# only; `kernel.prepare_weights` warns once when the data rules the words out).
MXFP4_PREFILL_TILES = TritonMoEConfig(
    block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4, gemm2_block_n=128
)
# The tl.dot tiles a MMA_WORDS_DECODE plan runs (its split_k kept) on weights that kept CHECKPOINT packing.
MXFP4_DECODE_TILES = TritonMoEConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)

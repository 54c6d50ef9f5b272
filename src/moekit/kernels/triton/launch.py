"""Host side of the Triton fused-MoE path: config, capabilities, and the launch of each stage.

Data flow of `triton_fused_moe` (no host sync anywhere, so the whole call can be graph-captured):
  spec -> `_KernelParams` (every spec parameter as a typed constexpr, derived once per spec)
  ids -> `align_routing` (pairs sorted by local expert, M-block metadata on the device)
  x -> [W8A8: `_quant_fp8_rows` -> fp8 x + scales] -> `_moe_gemm1` -> h [T*K, I]
    -> [W8A8: `_quant_fp8_rows` -> fp8 h + scales] -> `_moe_gemm2` -> y [T*K, H]
    -> `_moe_sum_k` -> out [T, H] (K == 1 without an expert map: `_moe_gemm2` writes out directly).
Workspace per call (`workspace_bytes`): h, y and the FP8 copies; nothing is cached between calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

import triton
from moekit.errors import DeviceError, DTypeError, LayoutMismatchError, ShapeError, SpecError
from moekit.formats.mxfp4_words import CHUNKS_PER_RUN, rows_reason
from moekit.kernels.base import Capabilities, DeviceInfo, DeviceKind, KernelConfig
from moekit.kernels.triton._details import gemm as _jit
from moekit.kernels.triton.align import BlockList, align_routing, split_tail_blocks
from moekit.routing import RoutingResult
from moekit.spec import (
    Activation,
    ActivationQuant,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)
from moekit.weights import ExpertWeights, WeightPacking

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
        _check_int(
            "max_registers",
            self.max_registers,
            lambda r: 32 <= r <= 255 and not r % 8,
            "a multiple of 8 in [32, 255] (ptxas' per-thread range)",
            optional=True,
        )

    def reason_unusable(self, spec: MoESpec) -> str | None:
        """None if this config can compute `spec`, else why not."""
        if spec.weight_format is WeightFormat.MXFP4 and self.block_k % 32:
            return f"MXFP4 needs block_k to cover whole 32-element scale groups, got block_k={self.block_k}"
        per_128 = spec.fp8_scale is Fp8Scale.BLOCK_128 or spec.act_quant is ActivationQuant.FP8_PER_GROUP_128
        if per_128 and self.block_k > 128:
            return f"128-wide FP8 scale groups need block_k <= 128, got {self.block_k}"
        if spec.act_quant is not ActivationQuant.NONE and self.block_k < 32:
            return f"FP8 x FP8 dots need block_k >= 32, got {self.block_k}"
        if spec.weight_format is WeightFormat.MXFP4 and self.num_warps > 4 and words_reason(spec) is None:
            # Session 3 (H200, before the K-step wgmma wait of `_jit._wait_for_mma`): rel L2 3e-3 on most
            # runs and 1e32 or inf on some. With the wait, 8-warp tiles passed one check per candidate in
            # session 5's sweep but were 11 - 58 % slower at every T, and no race hunt has cleared them:
            # refused until one does (benchmarks/RESULTS.md).
            return (
                f"the MXFP4 word path (MXFP4_MMA_WORDS, {spec.act_dtype} activations) is not verified with "
                f"{self.num_warps} warps (it gave intermittently wrong results before the K-step wgmma wait, "
                f"and was slower after it); use num_warps=4"
            )
        return None


@functools.cache  # `reason_unusable` asks on every forward (`_check`)
def words_reason(spec: MoESpec) -> str | None:
    """None if `spec`'s shapes and activations allow MXFP4_MMA_WORDS, else why not. The weights'
    scale bytes must fit too (`mxfp4_words.scales_reason`), which only the data can tell."""
    if spec.act_dtype not in (torch.bfloat16, torch.float32):
        return f"the word decode writes bf16 or fp32 operands, activations are {spec.act_dtype}"
    for name, rows in (("w13", 2 * spec.I), ("w2", spec.H)):
        reason = rows_reason(rows)
        if reason is not None:
            return f"{name}: {reason}"
    return None


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
    packings=frozenset({WeightPacking.CHECKPOINT, WeightPacking.MXFP4_MMA_WORDS}),
    min_compute_capability=(8, 0),  # the float formats; FP8 and MXFP4 need 9.0 (`min_compute_capability`)
)
# FP8 dots (and our MXFP4 path, validated only on Hopper) need sm_90; the float formats run on sm_80.
MIN_COMPUTE_CAPABILITY: dict[WeightFormat, tuple[int, int]] = {
    WeightFormat.BF16: (8, 0),
    WeightFormat.FP16: (8, 0),
    WeightFormat.FP32: (8, 0),
    WeightFormat.FP8_E4M3: (9, 0),
    WeightFormat.MXFP4: (9, 0),
}


def min_compute_capability(spec: MoESpec) -> tuple[int, int]:
    return MIN_COMPUTE_CAPABILITY[spec.weight_format]


def triton_supports(spec: MoESpec, *, device: DeviceInfo | None = None) -> str | None:
    """None if the Triton path computes `spec` (on `device`, if given), else the reason it cannot."""
    reason = TRITON_CAPABILITIES.check(spec, device)
    if reason is not None:
        return reason
    if device is not None and device.kind is DeviceKind.CUDA:
        need = min_compute_capability(spec)
        if (device.compute_capability or (0, 0)) < need:
            return (
                f"{spec.weight_format.name} needs compute capability >= {need[0]}.{need[1]}, "
                f"device has {device.compute_capability}"
            )
    return None


def _tokens_per_expert(spec: MoESpec, num_tokens: int) -> float:
    return max(num_tokens, 1) * spec.K / spec.E_local


def default_config(spec: MoESpec, num_tokens: int) -> TritonMoEConfig:
    """A capable config without tuning: tiles grow with the tokens each expert sees on average.

    Chosen from sweeps on an H200 (whole layer, graph replay, L2 flushed; benchmarks/RESULTS.md);
    the tuned rows of `moekit/tables/h200.json` refine it per model and T.
    """
    per_expert = _tokens_per_expert(spec, num_tokens)
    if spec.act_dtype == torch.float32 and spec.act_quant is ActivationQuant.NONE:
        # fp32 dots run on FMA units (exact-comparison path): small tiles keep registers in check.
        return TritonMoEConfig(block_m=16 if per_expert <= 16 else 32, block_n=32, block_k=32, num_stages=2)
    fmt = spec.weight_format
    if fmt is WeightFormat.MXFP4:
        if per_expert <= 8:  # weight streaming: the decode, not the MMA, sets the pace
            return TritonMoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
        if per_expert <= 24:
            return TritonMoEConfig(block_m=32, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
        if per_expert <= 96:
            return TritonMoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
        return TritonMoEConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
    if fmt is WeightFormat.FP8_E4M3:
        # Wider N tiles spill: FP8 keeps a second fp32 tile per K-step (the per-tile promotion).
        if per_expert <= 16:
            return TritonMoEConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=3)
        return TritonMoEConfig(block_m=64, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
    if per_expert <= 8:
        return TritonMoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=3)
    if per_expert <= 32:
        return TritonMoEConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=3)
    return TritonMoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def tuning_space(spec: MoESpec, num_tokens: int) -> tuple[TritonMoEConfig, ...]:
    """`default_config` first, then tiles for the regime of tokens per expert (see TritonFusedKernel)."""
    per_expert = _tokens_per_expert(spec, num_tokens)
    mxfp4 = spec.weight_format is WeightFormat.MXFP4
    default = default_config(spec, num_tokens)
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
        # slower for gpt-oss on an H200 at every T <= 256 (benchmarks/RESULTS.md, session 3): not swept.
    elif per_expert <= 32:
        tiles = [
            (16, 64, 64, 4, 4, 4),
            (32, 64, 64, 4, 4, 4),
            (32, 64, 64, 4, 8, 4),
            (32, 128, 64, 4, 8, 4),
            (64, 64, 64, 8, 4, 4),
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
        # 8-warp MXFP4 tiles (block_m 256, block_n / block_k 128) were 2 - 13 % slower at T >= 2048 on an
        # H200 before the word path refused them (`reason_unusable`); RESULTS.md, session 3.
        if mxfp4:  # 64 rows of w13 a tile: a third the registers, three programs an SM instead of two
            tiles += [(128, 32, 64, 8, 4, 3), (128, 32, 64, 8, 4, 4), (256, 32, 64, 8, 4, 3)]
    # MXFP4 upcasts on the register side of the MMA whichever way round (Triton's dot_scaled), so
    # swapping only adds a transpose there; float and FP8 weights try it while M tiles are small.
    swaps = (False,) if mxfp4 or per_expert > 8 else (False, True)
    # GEMM2's tile is half GEMM1's (no gate/up pair): 4-warp tiles also try GEMM2 on 128 weight rows,
    # the size of GEMM1's operand, which halves the activation rows GEMM2 re-reads per weight row.
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
        for n2 in {(64, 4): (None, 128), (32, 4): (64, 128)}.get((n, w), (None,))
    ]
    if num_tokens * spec.K <= 32:
        # A decode step of few pairs hits at most that many experts: T = 1 of gpt-oss-120b runs 4 x 45
        # GEMM1 programs on 132 SMs. Split-K multiplies the programs (and weight bytes in flight).
        grid += [replace(default, split_k=s, gemm2_block_n=n2) for s in (2, 3, 4) for n2 in (None, 128)]
    if per_expert > 32:
        # Each expert's odd last half-block in a second launch (tail_block_m): 1 - 8 % faster for gpt-oss-120b
        # at T = 2048 - 16384 on an H200 (benchmarks/RESULTS.md, session 7).
        grid += [replace(c, tail_block_m=c.block_m // 2) for c in grid if c.block_m >= 64 and c.split_k == 1]
    # 64 weight rows x 256 tokens (wgmma m64n256; block_m 256, block_n 32, GEMM2 64) decodes half the weights
    # per FLOP of 128 x 128 but was 5 - 75 % slower for gpt-oss-120b at T = 2048 - 16384 on an H200
    # (benchmarks/RESULTS.md, session 4): not swept.
    unique = dict.fromkeys([default, *grid])
    return tuple(c for c in unique if c.reason_unusable(spec) is None)


@dataclass(frozen=True)
class _KernelParams:
    """Every spec parameter as the constexpr the kernels take; the only way the spec reaches them."""

    w_format: int
    fp8_scale: int
    a_quant: int
    dot_fp32: bool  # fp32 dots (IEEE) when activations are fp32 or float weights differ from them
    interleaved: bool
    has_bias: bool
    route_in_gemm1: bool  # INPUT placement: GEMM1 scales its rows by the router weight
    route_in_quant: bool  # INPUT placement with W8A8: w * x is quantized (as the reference does)
    route_on_output: bool  # OUTPUT placement: GEMM2 scales its rows by the router weight
    activation: int
    alpha: float
    has_limit: bool
    limit: float
    h_dtype: torch.dtype  # intermediate between the GEMMs

    @classmethod
    @functools.cache
    def of(cls, spec: MoESpec) -> _KernelParams:
        act = spec.activation
        w8a8 = spec.act_quant is not ActivationQuant.NONE
        on_input = spec.router_weight_placement is RouterWeightPlacement.INPUT
        return cls(
            w_format=_W_FORMAT[spec.weight_format],
            fp8_scale=_FP8_SCALE[spec.fp8_scale],
            a_quant=_A_QUANT[spec.act_quant],
            dot_fp32=spec.act_dtype == torch.float32
            or (not spec.weight_format.is_quantized and spec.weight_format.float_dtype != spec.act_dtype),
            interleaved=spec.gate_layout is GateLayout.INTERLEAVED,
            has_bias=spec.has_bias,
            route_in_gemm1=on_input and not w8a8,
            route_in_quant=on_input and w8a8,
            route_on_output=not on_input,
            activation=_ACTIVATION[act.kind],
            alpha=float(act.alpha) if act.alpha is not None else 0.0,
            has_limit=act.limit is not None,
            limit=float(act.limit) if act.limit is not None else 0.0,
            # W8A8 quantizes h from fp32, as the reference does; rounding to bf16 first would move codes.
            h_dtype=torch.float32 if w8a8 else spec.act_dtype,
        )


_W_FORMAT = {
    WeightFormat.BF16: _jit.WFMT_FLOAT.value,
    WeightFormat.FP16: _jit.WFMT_FLOAT.value,
    WeightFormat.FP32: _jit.WFMT_FLOAT.value,
    WeightFormat.FP8_E4M3: _jit.WFMT_FP8.value,
    WeightFormat.MXFP4: _jit.WFMT_MXFP4.value,
}
_FP8_SCALE = {
    None: _jit.FP8S_TENSOR.value,
    Fp8Scale.PER_TENSOR: _jit.FP8S_TENSOR.value,
    Fp8Scale.PER_CHANNEL: _jit.FP8S_CHANNEL.value,
    Fp8Scale.BLOCK_128: _jit.FP8S_BLOCK.value,
}
_A_QUANT = {
    ActivationQuant.NONE: _jit.AQ_NONE.value,
    ActivationQuant.FP8_PER_TOKEN: _jit.AQ_TOKEN.value,
    ActivationQuant.FP8_PER_GROUP_128: _jit.AQ_GROUP.value,
}
_ACTIVATION = {
    Activation.SILU: _jit.ACT_SILU.value,
    Activation.GELU: _jit.ACT_GELU.value,
    Activation.GELU_TANH: _jit.ACT_GELU_TANH.value,
    Activation.SWIGLU_OAI: _jit.ACT_SWIGLU_OAI.value,
}


def workspace_bytes(*, spec: MoESpec, num_tokens: int, split_k: int = 1) -> int:
    """Device memory one call allocates besides `out` (h, y, the FP8 copies for W8A8, and the fp32
    split-K shares of `config.split_k` > 1)."""
    pairs = num_tokens * spec.K
    act = torch.empty((), dtype=spec.act_dtype).element_size()
    params = _KernelParams.of(spec)
    total = pairs * spec.I * torch.empty((), dtype=params.h_dtype).element_size()
    total += pairs * spec.H * act  # y (skipped when K == 1 without an expert map; counted anyway)
    if params.a_quant:
        codes = num_tokens * spec.H + pairs * spec.I  # one byte each, plus fp32 scales per 128 at most
        total += codes + 4 * (codes // 128 + num_tokens + pairs)
    if split_k > 1:  # the fp32 shares of both GEMMs (y is not allocated then; counted anyway)
        total += split_k * pairs * (2 * spec.I + spec.H) * 4
    return total + 16 * pairs  # routing metadata, roughly


@dataclass(frozen=True)
class _WeightArgs:
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
    ) -> _WeightArgs:
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
            stride_be=_stride(bias, 0),
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


def _check(x, weights, routing, *, spec, config, expert_map, out) -> None:
    """Shape, dtype, device and layout checks that never read device memory (no sync)."""
    if not isinstance(config, TritonMoEConfig):
        raise SpecError(f"config must be a TritonMoEConfig, got {type(config).__name__}")
    reason = triton_supports(spec) or config.reason_unusable(spec)
    if reason is not None:
        raise SpecError(f"the Triton path cannot run this spec ({spec.describe()}): {reason}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != spec.H:
        raise ShapeError(f"x must be [T, H={spec.H}], got {getattr(x, 'shape', x)!r}")
    if x.dtype != spec.act_dtype:
        raise DTypeError(f"x has dtype {x.dtype} but spec.act_dtype is {spec.act_dtype}")
    weights.validate(spec)
    if weights.packing not in TRITON_CAPABILITIES.packings:
        names = sorted(p.name for p in TRITON_CAPABILITIES.packings)
        raise LayoutMismatchError(f"the Triton path reads packings {names}, got {weights.packing.name}")
    if not isinstance(routing, RoutingResult) or tuple(routing.ids.shape) != (x.shape[0], spec.K):
        raise ShapeError(f"routing must be a RoutingResult [T={x.shape[0]}, K={spec.K}]")
    if spec.uses_expert_map != (expert_map is not None):
        raise SpecError(
            f"spec.num_local_experts={spec.num_local_experts} "
            f"{'needs' if spec.uses_expert_map else 'forbids'} an expert_map"
        )
    if expert_map is not None and (expert_map.shape != (spec.E,) or expert_map.dtype != torch.int32):
        raise ShapeError(
            f"expert_map must be int32 [E={spec.E}], got {expert_map.dtype} {tuple(expert_map.shape)}"
        )
    if out is not None and (
        tuple(out.shape) != (x.shape[0], spec.H) or out.dtype != spec.act_dtype or out.stride(1) != 1
    ):
        raise ShapeError(
            f"out must be [T, H={spec.H}] {spec.act_dtype} with contiguous rows, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    others = (("weights", weights.w13), ("routing", routing.ids), ("expert_map", expert_map), ("out", out))
    for name, t in others:
        if t is not None and t.device != x.device:
            raise DeviceError(f"x is on {x.device} but {name} is on {t.device}; move them to one device")


def _stride(t: torch.Tensor | None, dim: int) -> int:
    """`t.stride(dim)`, or 0 for an absent tensor (the kernel never reads through it)."""
    return 0 if t is None else t.stride(dim)


def _quantize_rows(
    src: torch.Tensor, *, quant: ActivationQuant, row_mult: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes [R, C] and fp32 scales [R, 1] / [R, ceil(C/128)] of `src`, exactly as moekit.formats."""
    rows, cols = src.shape
    per_group = quant is ActivationQuant.FP8_PER_GROUP_128
    groups = triton.cdiv(cols, 128) if per_group else 1
    data = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=src.device)
    scale = torch.empty(rows, groups, dtype=torch.float32, device=src.device)
    _jit._quant_fp8_rows[(rows, groups)](
        src_ptr=src,  # [R, C]
        row_mult_ptr=row_mult,  # fp32 [R] or None
        dst_ptr=data,  # fp8 [R, C]
        scale_ptr=scale,  # fp32 [R, G]
        stride_src=src.stride(0),
        stride_dst=data.stride(0),
        stride_scale=scale.stride(0),
        NUM_COLS=cols,
        GROUP_COLS=128 if per_group else cols,
        HAS_ROW_MULT=row_mult is not None,
        BLOCK=128 if per_group else min(1024, triton.next_power_of_2(cols)),
    )
    return data, scale


def _block_args(blocks: BlockList) -> dict:
    """The M-block arguments of `_moe_gemm1` / `_moe_gemm2` for one launch over `blocks`."""
    return dict(
        block_expert_ptr=blocks.block_expert,  # int32 [num_pid_m]
        block_start_ptr=blocks.block_start,  # int32 [num_pid_m] or None
        num_blocks_ptr=blocks.num_valid_blocks,  # int32 [1]
        num_pid_m=blocks.max_blocks,
        BLOCK_M=blocks.block_m,
    )


def triton_fused_moe(
    x: torch.Tensor,
    weights: ExpertWeights,
    routing: RoutingResult,
    *,
    spec: MoESpec,
    config: TritonMoEConfig,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MoE layer of `spec` on CUDA (or the Triton interpreter): `[T, H]` in spec.act_dtype.

    Matches `moekit.reference.fused_moe_reference`. Routing ids are not range-checked here (that
    syncs): out-of-range ids are dropped. `out`, if given, receives the result (and is returned).
    """
    _check(x, weights, routing, spec=spec, config=config, expert_map=expert_map, out=out)
    num_tokens, top_k = x.shape[0], spec.K
    if out is None:
        out = torch.empty(num_tokens, spec.H, dtype=spec.act_dtype, device=x.device)
    if num_tokens == 0:
        return out
    p = _KernelParams.of(spec)
    cfg = config
    tail = cfg.tail_block_m
    aligned = align_routing(
        routing.ids, num_local_experts=spec.E_local, block_m=tail or cfg.block_m, expert_map=expert_map
    )
    # One launch of each GEMM per block list: block_m blocks, then (tail) each expert's odd last tail block.
    block_lists = split_tail_blocks(aligned) if tail else (BlockList.of(aligned),)
    block_lists = tuple(b for b in block_lists if b.max_blocks > 0)
    route_w = routing.weights.contiguous().view(-1)  # fp32 [T*K], indexed by pair id t*K + k
    x = x if x.stride(1) == 1 else x.contiguous()
    quant = spec.act_quant
    x_scale = None
    if p.a_quant:
        # INPUT placement has K == 1, so route_w [T*K] is indexed by token.
        x, x_scale = _quantize_rows(x, quant=quant, row_mult=route_w if p.route_in_quant else None)
    w13 = _WeightArgs.of(weights.w13, weights.w13_scale, weights.b13, name="w13")
    w2 = _WeightArgs.of(weights.w2, weights.w2_scale, weights.b2, name="w2")
    num_pairs = aligned.num_pairs
    words = weights.packing is WeightPacking.MXFP4_MMA_WORDS
    w_format = _jit.WFMT_MXFP4_WORDS.value if words else p.w_format
    # Compiled bf16 only: tl.dot_scaled and inline PTX have no interpreter implementation, and
    # dot_scaled upcasts to bf16 (fp16 would lose bits).
    mx_native = p.w_format == _jit.WFMT_MXFP4.value and spec.act_dtype == torch.bfloat16
    mx_native = mx_native and x.device.type == "cuda"

    # Arguments both GEMMs take under the same names: routing metadata, format switches, tiles but N.
    shared = dict(
        sorted_pairs_ptr=aligned.sorted_pair_ids,  # int32 [aligned.max_blocks * aligned.block_m]
        num_pairs=num_pairs,
        HIDDEN=spec.H,
        INTER_SIZE=spec.I,
        W_FORMAT=w_format,
        FP8_SCALE=p.fp8_scale,
        A_QUANT=p.a_quant,
        DOT_FP32=p.dot_fp32,
        MX_NATIVE=mx_native,
        SWAP_AB=cfg.swap_ab,
        HAS_BIAS=p.has_bias,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        # A compile option, not a kernel argument: only passed when set (one cache entry otherwise).
        **({"maxnreg": cfg.max_registers} if cfg.max_registers is not None else {}),
    )

    splits = cfg.split_k
    split = splits > 1  # fp32 shares, summed and finished by _moe_gemm1_splits / _moe_sum_k
    # GEMM1's epilogue (bias, router weight on the input, activation), run by GEMM1 itself or, split,
    # by _moe_gemm1_splits: the same switches for both.
    epilogue1 = dict(
        INTERLEAVED=p.interleaved,
        ROUTE_ON_INPUT=p.route_in_gemm1,
        ACTIVATION=p.activation,
        ALPHA=p.alpha,
        HAS_LIMIT=p.has_limit,
        LIMIT=p.limit,
    )
    h = torch.empty(num_pairs, spec.I, dtype=p.h_dtype, device=x.device)
    part1 = (
        torch.empty(splits, num_pairs, 2 * spec.I, dtype=torch.float32, device=x.device) if split else None
    )
    for blocks in block_lists:
        _jit._moe_gemm1[(blocks.max_blocks * triton.cdiv(spec.I, cfg.block_n), splits)](
            x_ptr=x,  # [T, H] act dtype or fp8
            x_scale_ptr=x_scale,  # fp32 [T, G] or None
            route_w_ptr=route_w if p.route_in_gemm1 else None,  # fp32 [T*K]
            h_ptr=h,  # [T*K, I]
            part_ptr=part1,  # fp32 [S, T*K, 2I] or None
            stride_xm=x.stride(0),
            stride_xsm=_stride(x_scale, 0),
            stride_xsk=_stride(x_scale, 1),
            stride_hm=h.stride(0),
            stride_part_split=_stride(part1, 0),
            stride_part_m=_stride(part1, 1),
            TOP_K=top_k,
            BLOCK_N=cfg.block_n,
            **epilogue1,
            **w13.kernel_args(),
            **shared,
            **_block_args(blocks),
        )
    if split:
        block_fin = min(1024, triton.next_power_of_2(spec.I))
        _jit._moe_gemm1_splits[(num_pairs, triton.cdiv(spec.I, block_fin))](
            part_ptr=part1,  # fp32 [S, T*K, 2I]
            pair_expert_ptr=aligned.pair_expert,  # int32 [T*K]
            b_ptr=w13.bias,  # [E_local, 2I] or None
            route_w_ptr=route_w if p.route_in_gemm1 else None,  # fp32 [T*K]
            h_ptr=h,  # [T*K, I]
            stride_part_split=part1.stride(0),
            stride_part_m=part1.stride(1),
            stride_be=w13.stride_be,
            stride_hm=h.stride(0),
            INTER_SIZE=spec.I,
            SPLIT_K=splits,
            HAS_BIAS=p.has_bias,
            BLOCK_N=block_fin,
            **epilogue1,
        )

    h_scale = None
    if p.a_quant:
        h, h_scale = _quantize_rows(h, quant=quant)
    direct = top_k == 1 and expert_map is None  # pair == token and every pair is local: no reduction
    if split:  # GEMM2's raw shares go to part2; _moe_sum_k finishes them into out
        part2, y = torch.empty(splits, num_pairs, spec.H, dtype=torch.float32, device=x.device), None
    else:
        part2 = None
        y = out if direct else torch.empty(num_pairs, spec.H, dtype=spec.act_dtype, device=x.device)
    block_n2 = cfg.block_n_gemm2
    for blocks in block_lists:
        _jit._moe_gemm2[(blocks.max_blocks * triton.cdiv(spec.H, block_n2), splits)](
            h_ptr=h,  # [T*K, I] act dtype or fp8
            h_scale_ptr=h_scale,  # fp32 [T*K, G] or None
            route_w_ptr=route_w if p.route_on_output else None,  # fp32 [T*K]
            y_ptr=y,  # [T*K, H] (or out [T, H] when K == 1), or None when split
            part_ptr=part2,  # fp32 [S, T*K, H] or None
            stride_hm=h.stride(0),
            stride_hsm=_stride(h_scale, 0),
            stride_hsk=_stride(h_scale, 1),
            stride_ym=_stride(y, 0),
            stride_part_split=_stride(part2, 0),
            stride_part_m=_stride(part2, 1),
            ROUTE_ON_OUTPUT=p.route_on_output,
            **w2.kernel_args(),
            BLOCK_N=block_n2,
            **shared,
            **_block_args(blocks),
        )
    if split or not direct:
        shares = part2 if split else y.unsqueeze(0)  # [S, T*K, H]
        block_h = min(1024, triton.next_power_of_2(spec.H))
        _jit._moe_sum_k[(num_tokens, triton.cdiv(spec.H, block_h))](
            y_ptr=shares,  # [S, T*K, H]: GEMM2's raw fp32 shares, or its finished rows
            pair_expert_ptr=aligned.pair_expert,  # int32 [T*K]
            b_ptr=w2.bias if split else None,  # [E_local, H] or None
            route_w_ptr=route_w if split and p.route_on_output else None,  # fp32 [T*K]
            out_ptr=out,  # [T, H]
            stride_ys=shares.stride(0),
            stride_ym=shares.stride(1),
            stride_be=w2.stride_be,
            stride_om=out.stride(0),
            HIDDEN=spec.H,
            TOP_K=top_k,
            SHARES=shares.shape[0],
            HAS_BIAS=split and p.has_bias,
            ROUTE_ON_OUTPUT=split and p.route_on_output,
            BLOCK_H=block_h,
        )
    return out

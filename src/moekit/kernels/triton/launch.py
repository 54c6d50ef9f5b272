"""The launch of the Triton fused-MoE path: spec -> constexprs, workspace, and each stage's kernel.

Data flow of `triton_fused_moe` (no host sync anywhere, so the whole call can be graph-captured):
  spec -> `_KernelParams` (every spec parameter as a typed constexpr code of `_details.codes`, once
  per spec) and `_check` (the config against the spec; the inputs were checked by the caller,
  `moekit.ops.fused_moe`, before any launch)
  ids -> `align_routing` (pairs sorted by local expert, M-block metadata on the device); a decode step of
  one token or of pairs sparse among the experts (`block_choice.takes_one_block_per_pair`) skips it: M-block b
  is pair b alone
  x -> [W8A8: `quant` -> fp8 x + scales] -> `gemm._moe_gemm1` -> h [T*K, I]
    -> [W8A8: `quant` -> fp8 h + scales, unless GEMM1 made them (`fuses_h_quantization`)]
    -> `gemm._moe_gemm2` -> y [T*K, H]
    -> `reduce._moe_sum_k` -> out [T, H] (K == 1 without an expert map: `_moe_gemm2` writes out directly).
Workspace per call (`workspace_bytes`): h, y and the FP8 copies; nothing is cached between calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

import triton
from moekit.errors import DeviceError, ShapeError, SpecError
from moekit.kernels.triton._details import codes
from moekit.kernels.triton._details.gemm import _moe_gemm1, _moe_gemm2
from moekit.kernels.triton._details.reduce import _moe_gemm1_splits
from moekit.kernels.triton.align import BlockList, gemm_blocks
from moekit.kernels.triton.config import (
    MXFP4_DECODE_TILES,
    MXFP4_PREFILL_TILES,
    MatmulEngine,
    TritonMoEConfig,
    triton_supports,
)
from moekit.kernels.triton.pdl import pdl_args
from moekit.kernels.triton.quantize import quantize_rows
from moekit.kernels.triton.sum_k import sum_shares
from moekit.kernels.triton.tuning import default_config
from moekit.kernels.triton.weight_args import WeightArgs, stride_or_zero
from moekit.kernels.triton.wgmma_bf16 import (
    gemm2_blocks,
    gluon_gemm1_runs,
    wgmma_bf16_gemm1,
    wgmma_bf16_gemm2,
)
from moekit.kernels.triton.wgmma_fp8 import wgmma_fp8_moe
from moekit.kernels.triton.wgmma_w4a8 import wgmma_w4a8_moe
from moekit.kernels.triton.wgmma_words import wgmma_words_moe
from moekit.kernels.triton.words_decode import decode_gemm, gemm2_split
from moekit.routing import RoutingResult
from moekit.spec import (
    ActivationQuant,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    WeightFormat,
)
from moekit.weights import ExpertWeights, WeightPacking


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
            activation=codes.ACTIVATION_CODE[act.kind],
            alpha=float(act.alpha) if act.alpha is not None else 0.0,
            has_limit=act.limit is not None,
            limit=float(act.limit) if act.limit is not None else 0.0,
            # W8A8 quantizes h from fp32, as the reference does; rounding to bf16 first would move codes.
            h_dtype=torch.float32 if w8a8 else spec.act_dtype,
        )


_W_FORMAT = {
    WeightFormat.BF16: codes.WFMT_FLOAT.value,
    WeightFormat.FP16: codes.WFMT_FLOAT.value,
    WeightFormat.FP32: codes.WFMT_FLOAT.value,
    WeightFormat.FP8_E4M3: codes.WFMT_FP8.value,
    WeightFormat.MXFP4: codes.WFMT_MXFP4.value,
}
_FP8_SCALE = {
    None: codes.FP8S_TENSOR.value,
    Fp8Scale.PER_TENSOR: codes.FP8S_TENSOR.value,
    Fp8Scale.PER_CHANNEL: codes.FP8S_CHANNEL.value,
    Fp8Scale.BLOCK_128: codes.FP8S_BLOCK.value,
}
_A_QUANT = {
    ActivationQuant.NONE: codes.AQ_NONE.value,
    ActivationQuant.FP8_PER_TOKEN: codes.AQ_TOKEN.value,
    ActivationQuant.FP8_PER_GROUP_128: codes.AQ_GROUP.value,
}


def share_counts(spec: MoESpec, config: TritonMoEConfig) -> tuple[int, int] | None:
    """The fp32 shares GEMM1 and GEMM2 write for the finish kernels, or None when each GEMM finishes its
    own rows: split-K > 1, or the MMA_WORDS_DECODE engine (always shares; GEMM2 at `gemm2_split`)."""
    if config.engine is MatmulEngine.MMA_WORDS_DECODE:
        return config.split_k, gemm2_split(spec, config.split_k)
    return (config.split_k, config.split_k) if config.split_k > 1 else None


def workspace_bytes(*, spec: MoESpec, num_tokens: int, shares: tuple[int, int] | None = None) -> int:
    """Device memory one call allocates besides `out` (h, y, the FP8 copies for W8A8, and the fp32
    shares of each GEMM, `share_counts`). An upper bound when GEMM1 quantizes h itself
    (`fuses_h_quantization`: no fp32 h then, only its FP8 copy)."""
    pairs = num_tokens * spec.K
    act = torch.empty((), dtype=spec.act_dtype).element_size()
    params = _KernelParams.of(spec)
    total = pairs * spec.I * torch.empty((), dtype=params.h_dtype).element_size()
    total += pairs * spec.H * act  # y (skipped when K == 1 without an expert map; counted anyway)
    if params.a_quant:
        fp8_bytes = num_tokens * spec.H + pairs * spec.I  # one byte each, plus fp32 scales per 128 at most
        total += fp8_bytes + 4 * (fp8_bytes // 128 + num_tokens + pairs)
    if shares is not None:  # the fp32 shares of both GEMMs (y is not allocated then; counted anyway)
        total += pairs * (shares[0] * 2 * spec.I + shares[1] * spec.H) * 4
    return total + 16 * pairs  # routing metadata, roughly


def _check(x, *, spec, config, out) -> None:
    """The launch's own invariants, without reading device memory (no sync): the config against the
    spec, and the arguments only the launch takes. The inputs against the spec (x, weights and their
    packing, routing, devices, the expert map's presence, shape and dtype) were checked by
    `moekit.ops.fused_moe` before any launch (`moekit.checks.check_forward`, `Kernel.weights_reason`)."""
    if not isinstance(config, TritonMoEConfig):
        raise SpecError(f"config must be a TritonMoEConfig, got {type(config).__name__}")
    reason = triton_supports(spec) or config.reason_unusable(spec)
    if reason is not None:
        raise SpecError(f"the Triton path cannot run this spec ({spec.describe()}): {reason}")
    if out is not None and (
        tuple(out.shape) != (x.shape[0], spec.H) or out.dtype != spec.act_dtype or out.stride(1) != 1
    ):
        raise ShapeError(
            f"out must be [T, H={spec.H}] {spec.act_dtype} with contiguous rows, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    if config.engine is not MatmulEngine.TL_DOT and (
        x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0)
    ):
        where = x.device if x.device.type != "cuda" else torch.cuda.get_device_name(x.device)
        raise DeviceError(
            f"the {config.engine.name} engine runs Hopper (sm_90) wgmma only, not on {where}; use a "
            f"TritonMoEConfig with engine=MatmulEngine.TL_DOT"
        )
    if out is not None and out.device != x.device:
        raise DeviceError(f"x is on {x.device} but out is on {out.device}; move them to one device")


def fuses_h_quantization(spec: MoESpec, config: TritonMoEConfig) -> bool:
    """Whether GEMM1's epilogue writes h as GEMM2's FP8 input (codes + per-1x128 scales) itself: per-group
    activation quantization, GEMM1 tiles of exactly one group (block_n 128, 128 | I) and no split-K (the
    shares are summed after GEMM1). Bit for bit the separate pass: same values, same arithmetic
    (`quant._fp8_group_codes`), without h's fp32 round trip through memory."""
    return (
        spec.act_quant is ActivationQuant.FP8_PER_GROUP_128
        and config.block_n == 128
        and spec.I % 128 == 0
        and config.split_k == 1
    )


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
    _check(x, spec=spec, config=config, out=out)
    num_tokens, top_k = x.shape[0], spec.K
    if out is None:
        out = torch.empty(num_tokens, spec.H, dtype=spec.act_dtype, device=x.device)
    if num_tokens == 0:
        return out
    if weights.packing is WeightPacking.MXFP4_W4A8:
        if config.engine is not MatmulEngine.WGMMA_W4A8:
            raise SpecError(
                f"MXFP4_W4A8 weights are read by the WGMMA_W4A8 engine only, the config runs "
                f"{config.engine.name}; plan with the kernel's default config, or keep CHECKPOINT packing "
                f"(ExpertWeights.unpacked()) for the tl.dot W4A8 path"
            )
        tiles = dict(num_stages=config.num_stages, group_m=config.group_m)
        return wgmma_w4a8_moe(x, weights, routing, spec=spec, **tiles, expert_map=expert_map, out=out)
    if config.engine is MatmulEngine.WGMMA_W4A8:  # weights not packed for it (`kernel.prepare_weights`)
        config = default_config(spec, num_tokens)  # the tl.dot W4A8 tiles of the regime (not Hopper's)
    if config.engine is MatmulEngine.WGMMA_FP8:
        return wgmma_fp8_moe(
            x,
            weights,
            routing,
            spec=spec,
            gemm1_stages=config.num_stages,
            group_m=config.group_m,
            gemm1_block_m=config.gemm1_block_m,
            expert_map=expert_map,
            out=out,
        )
    if config.engine is MatmulEngine.WGMMA_WORDS and weights.packing is WeightPacking.MXFP4_MMA_WORDS:
        tiles = dict(block_m=config.block_m, num_stages=config.num_stages, group_m=config.group_m)
        return wgmma_words_moe(x, weights, routing, spec=spec, **tiles, expert_map=expert_map, out=out)
    if weights.packing is not WeightPacking.MXFP4_MMA_WORDS:  # scale bytes above 128 (warned at load)
        if config.engine is MatmulEngine.WGMMA_WORDS:
            config = MXFP4_PREFILL_TILES
        if config.engine is MatmulEngine.MMA_WORDS_DECODE:
            config = replace(MXFP4_DECODE_TILES, split_k=config.split_k)
    p = _KernelParams.of(spec)
    cfg = config
    num_pairs = routing.ids.numel()
    x = x if x.stride(1) == 1 else x.contiguous()
    engine = cfg.engine is MatmulEngine.WGMMA_BF16  # GEMM2 on Gluon, reading h in the sorted rows
    gluon_gemm1 = engine and cfg.gemm1_gluon and gluon_gemm1_runs(spec, x)
    blocks = gemm_blocks(
        routing.ids,
        num_local_experts=spec.E_local,
        # The Gluon GEMM1 walks GEMM2's blocks: the alignment alone, no tail lists for a tl.dot GEMM1.
        block_m=cfg.alignment_rows if gluon_gemm1 else cfg.block_m,
        tail_block_m=None if gluon_gemm1 else cfg.tail_block_m,
        expert_map=expert_map,
        expert_bytes=spec.expert_weight_bytes,
        always_aligned=engine,
    )
    block_lists, sorted_pairs, pair_expert = blocks.block_lists, blocks.sorted_pair_ids, blocks.pair_expert
    sorted_h = blocks.aligned if engine else None
    engine_blocks = gemm2_blocks(sorted_h) if engine else None  # both Gluon GEMMs' 128-row blocks
    route_w = routing.weights.contiguous().view(-1)  # fp32 [T*K], indexed by pair id t*K + k
    quant = spec.act_quant
    x_scale = None
    if p.a_quant:
        # INPUT placement has K == 1, so route_w [T*K] is indexed by token.
        x, x_scale = quantize_rows(x, quant=quant, row_mult=route_w if p.route_in_quant else None)
    w13 = WeightArgs.of(weights.w13, weights.w13_scale, weights.b13, name="w13")
    w2 = WeightArgs.of(weights.w2, weights.w2_scale, weights.b2, name="w2")
    words = weights.packing is WeightPacking.MXFP4_MMA_WORDS
    w_format = codes.WFMT_MXFP4_WORDS.value if words else p.w_format
    # Compiled bf16 only: tl.dot_scaled and inline PTX have no interpreter implementation, and
    # dot_scaled upcasts to bf16 (fp16 would lose bits).
    mx_native = p.w_format == codes.WFMT_MXFP4.value and spec.act_dtype == torch.bfloat16
    mx_native = mx_native and x.device.type == "cuda" and not p.a_quant  # W4A8 has its own FP8 decode

    pdl = pdl_args(x.device)  # every launch below, the split-K finish included
    # Arguments both GEMMs take under the same names: routing metadata, format switches, tiles but N.
    shared = dict(
        **pdl,
        sorted_pairs_ptr=sorted_pairs,  # int32 [max_blocks * block_m], or None: block b is pair b
        num_pairs=num_pairs,
        num_local_experts=spec.E_local,
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
    decode = cfg.engine is MatmulEngine.MMA_WORDS_DECODE
    shares = share_counts(spec, cfg)
    split = shares is not None  # fp32 shares, summed and finished by _moe_gemm1_splits / _moe_sum_k
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
    quant_h = fuses_h_quantization(spec, cfg)
    if quant_h:
        h = torch.empty(num_pairs, spec.I, dtype=torch.float8_e4m3fn, device=x.device)
        h_scale = torch.empty(num_pairs, spec.I // 128, dtype=torch.float32, device=x.device)
    else:
        h_rows = sorted_h.max_blocks * sorted_h.block_m if engine else num_pairs
        h = torch.empty(h_rows, spec.I, dtype=p.h_dtype, device=x.device)
        h_scale = None
    part1 = (
        torch.empty(splits, num_pairs, 2 * spec.I, dtype=torch.float32, device=x.device) if split else None
    )
    dec = dict(
        sorted_pairs=sorted_pairs, num_pairs=num_pairs, num_local_experts=spec.E_local, depth=cfg.num_stages
    )
    if gluon_gemm1:
        route_in = route_w if p.route_in_gemm1 else None
        activation = {name: epilogue1[name] for name in ("ACTIVATION", "ALPHA", "HAS_LIMIT", "LIMIT")}
        gemm1_args = (x, weights.w13, w13.bias, route_in, sorted_h, engine_blocks, h)
        wgmma_bf16_gemm1(*gemm1_args, spec=spec, group_m=cfg.group_m, activation=activation)
    for blocks in () if gluon_gemm1 else block_lists:
        if decode:
            decode_gemm(
                x,
                a_row_div=top_k,
                words=weights.w13,
                scales=weights.w13_scale,
                blocks=blocks,
                part=part1,
                split_k=splits,
                **dec,
            )
            continue
        _moe_gemm1[(blocks.max_blocks * triton.cdiv(spec.I, cfg.block_n), splits)](
            x_ptr=x,  # [T, H] act dtype or fp8
            x_scale_ptr=x_scale,  # fp32 [T, G] or None
            route_w_ptr=route_w if p.route_in_gemm1 else None,  # fp32 [T*K]
            h_ptr=h,  # [T*K, I] (fp8 with QUANT_H)
            h_scale_ptr=h_scale,  # fp32 [T*K, I/128] or None
            part_ptr=part1,  # fp32 [S, T*K, 2I] or None
            stride_xm=x.stride(0),
            stride_xsm=stride_or_zero(x_scale, 0),
            stride_xsk=stride_or_zero(x_scale, 1),
            stride_hm=h.stride(0),
            stride_hsm=stride_or_zero(h_scale, 0),
            QUANT_H=quant_h,
            H_SORTED=engine,
            stride_part_split=stride_or_zero(part1, 0),
            stride_part_m=stride_or_zero(part1, 1),
            TOP_K=top_k,
            BLOCK_N=cfg.block_n,
            **epilogue1,
            **w13.kernel_args(),
            **shared,
            **_block_args(blocks),
        )
    if split:
        block_fin = min(1024, triton.next_power_of_2(spec.I))
        _moe_gemm1_splits[(num_pairs, triton.cdiv(spec.I, block_fin))](
            **pdl,
            part_ptr=part1,  # fp32 [S, T*K, 2I]
            pair_expert_ptr=pair_expert,  # int32 [T*K]
            b_ptr=w13.bias,  # [E_local, 2I] or None
            route_w_ptr=route_w if p.route_in_gemm1 else None,  # fp32 [T*K]
            h_ptr=h,  # [T*K, I]
            num_local_experts=spec.E_local,
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

    if p.a_quant and not quant_h:
        h, h_scale = quantize_rows(h, quant=quant)
    direct = top_k == 1 and expert_map is None  # pair == token and every pair is local: no reduction
    if split:  # GEMM2's raw shares go to part2; _moe_sum_k finishes them into out
        part2, y = torch.empty(shares[1], num_pairs, spec.H, dtype=torch.float32, device=x.device), None
    else:
        part2 = None
        y = out if direct else torch.empty(num_pairs, spec.H, dtype=spec.act_dtype, device=x.device)
    block_n2 = cfg.block_n_gemm2
    if engine:
        route = route_w if p.route_on_output else None
        gemm2_args = (h, w2.data, w2.bias, route, sorted_h, engine_blocks, y)
        wgmma_bf16_gemm2(*gemm2_args, spec=spec, block_n=block_n2, group_m=cfg.group_m)
    for blocks in () if engine else block_lists:
        if decode:
            w2_words = dict(words=weights.w2, scales=weights.w2_scale)
            decode_gemm(h, a_row_div=1, **w2_words, blocks=blocks, part=part2, split_k=part2.shape[0], **dec)
            continue
        _moe_gemm2[(blocks.max_blocks * triton.cdiv(spec.H, block_n2), splits)](
            h_ptr=h,  # [T*K, I] act dtype or fp8
            h_scale_ptr=h_scale,  # fp32 [T*K, G] or None
            route_w_ptr=route_w if p.route_on_output else None,  # fp32 [T*K]
            y_ptr=y,  # [T*K, H] (or out [T, H] when K == 1), or None when split
            part_ptr=part2,  # fp32 [S, T*K, H] or None
            stride_hm=h.stride(0),
            stride_hsm=stride_or_zero(h_scale, 0),
            stride_hsk=stride_or_zero(h_scale, 1),
            stride_ym=stride_or_zero(y, 0),
            stride_part_split=stride_or_zero(part2, 0),
            stride_part_m=stride_or_zero(part2, 1),
            ROUTE_ON_OUTPUT=p.route_on_output,
            **w2.kernel_args(),
            BLOCK_N=block_n2,
            **shared,
            **_block_args(blocks),
        )
    if split or not direct:
        shares = part2 if split else y.unsqueeze(0)  # [S, T*K, H]
        sum_shares(
            shares,
            pair_expert=pair_expert,
            out=out,
            spec=spec,
            finish=split,
            bias=w2.bias if split else None,
            stride_be=w2.stride_be,
            route_w=route_w if split and p.route_on_output else None,
        )
    return out

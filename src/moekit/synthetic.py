"""Deterministic random layers for runs, tests and benchmarks (never zeros).

Data flow: a `MoESpec` and a seed -> `ExpertWeights` in the spec's format, router weights and tokens.
Quantized formats are drawn directly as codes and scales (not by quantizing huge fp32 tensors), so a
gpt-oss-20b layer appears in a second on a CPU. Scales are chosen so that dequantized weights have a
standard deviation near `weight_std` (real checkpoints: about 0.02).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moekit.formats import fp8_weight_scale_shape, mxfp4_groups
from moekit.ops import route
from moekit.routing import RoutingResult
from moekit.spec import MoESpec, WeightFormat
from moekit.weights import ExpertWeights

# RMS of the 16 E2M1 values drawn uniformly: sqrt(mean(v^2)) over {0,.5,1,1.5,2,3,4,6} = 2.73.
_FP4_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)


@dataclass(frozen=True)
class SyntheticLayer:
    spec: MoESpec
    weights: ExpertWeights
    router_weight: torch.Tensor  # [E, H] in act dtype
    correction_bias: torch.Tensor | None  # [E] fp32, SIGMOID_GROUPED with bias only


def _mxfp4_matrix(
    e: int, n: int, k: int, *, std: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    groups = mxfp4_groups(k)
    blocks = torch.randint(0, 256, (e, n, groups, 16), generator=gen, dtype=torch.uint8, device=gen.device)
    if k % 32:  # padded tail elements of the last group must be zero codes, as a quantizer writes them
        tail = k % 32
        first_pad_byte = tail // 2
        if tail % 2:  # the odd element of this byte is padding: keep only the low nibble
            blocks[:, :, -1, first_pad_byte] &= 0x0F
            first_pad_byte += 1
        blocks[:, :, -1, first_pad_byte:] = 0
    center = 127 + round(math.log2(std / _FP4_RMS))
    scales = torch.randint(
        center - 1, center + 2, (e, n, groups), generator=gen, dtype=torch.int32, device=gen.device
    )
    return blocks, scales.to(torch.uint8)


def _fp8_matrix(e: int, n: int, k: int, spec: MoESpec, *, std: float, gen: torch.Generator):
    data = (
        (torch.randn(e, n, k, generator=gen, device=gen.device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    )
    shape = fp8_weight_scale_shape(lead=(e,), n=n, k=k, granularity=spec.fp8_scale)
    scale = (std / 64) * (0.75 + 0.5 * torch.rand(shape, generator=gen, device=gen.device))
    return data, scale.float()


def random_layer(
    spec: MoESpec, *, seed: int = 0, weight_std: float = 0.02, device: torch.device | str = "cpu"
) -> SyntheticLayer:
    """A layer of `spec.E_local` experts with deterministic random weights, drawn on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = gen.device
    e, h, i = spec.E_local, spec.H, spec.I
    fmt = spec.weight_format
    bias = {}
    if spec.has_bias:
        bias = dict(
            b13=torch.randn(e, 2 * i, generator=gen, device=dev) * 0.05,
            b2=torch.randn(e, h, generator=gen, device=dev) * 0.05,
        )
        bias = {n: t.to(spec.act_dtype) for n, t in bias.items()}
    s13 = s2 = None  # float formats carry no scales
    if fmt is WeightFormat.MXFP4:
        w13, s13 = _mxfp4_matrix(e, 2 * i, h, std=weight_std, gen=gen)
        w2, s2 = _mxfp4_matrix(e, h, i, std=weight_std, gen=gen)
    elif fmt is WeightFormat.FP8_E4M3:
        w13, s13 = _fp8_matrix(e, 2 * i, h, spec, std=weight_std, gen=gen)
        w2, s2 = _fp8_matrix(e, h, i, spec, std=weight_std, gen=gen)
    else:
        w13 = (torch.randn(e, 2 * i, h, generator=gen, device=dev) * weight_std).to(fmt.float_dtype)
        w2 = (torch.randn(e, h, i, generator=gen, device=dev) * weight_std).to(fmt.float_dtype)
    weights = ExpertWeights(
        format=fmt,
        gate_layout=spec.gate_layout,
        w13=w13,
        w13_scale=s13,
        w2=w2,
        w2_scale=s2,
        fp8_scale=spec.fp8_scale,  # None unless FP8_E4M3 (MoESpec checks)
        hidden_size=h,
        **bias,
    )
    router = (torch.randn(spec.E, h, generator=gen, device=dev) / math.sqrt(h)).to(spec.act_dtype)
    correction = None
    if spec.routing.has_correction_bias:
        correction = torch.randn(spec.E, generator=gen, device=dev) * 0.1
    return SyntheticLayer(spec=spec, weights=weights, router_weight=router, correction_bias=correction)


def random_tokens(
    spec: MoESpec, num_tokens: int, *, seed: int = 1, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Activations `[T, H]` with unit-scale entries, in the spec's activation dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(num_tokens, spec.H, generator=gen, device=gen.device).to(spec.act_dtype)


def random_batch(
    spec: MoESpec,
    num_tokens: int,
    *,
    correction_bias: torch.Tensor | None,
    seed: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, RoutingResult]:
    """Tokens `[T, H]`, router logits `[T, E]` (fp32, standard normal) and their routing, from one seed."""
    x = random_tokens(spec, num_tokens, seed=seed, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(num_tokens, spec.E, generator=gen, device=gen.device)
    routing = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=correction_bias)
    return x, logits, routing

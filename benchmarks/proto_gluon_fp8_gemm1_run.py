"""The GPU half of benchmarks/proto_gluon_fp8_gemm1.py: per T, the WGMMA_FP8 engine's GEMM1 and the
prototype (its GEMM1, then `launch._quantize_rows` on h) on the same sorted FP8 rows of x, both outputs
NaN-poisoned first; the prototype's h against the engine's (FP8 codes that differ, rel L2 of the
dequantized rows) and against torch; both timed (graph replay, L2 flushed, as `flushed_seconds` does).

Data flow: preset layer (block-128 W8A8) -> routing -> `align_routing(64)` -> `_sorted_fp8_rows` ->
engine: `_fp8_gemm1` over the 64-row blocks -> h codes + scales | prototype: `_gemm1_rows128` over
`paired_blocks` -> h fp32 -> `_quantize_rows` -> h codes + scales.
"""

from __future__ import annotations

import functools

from proto_gluon_fp8_gemm1 import HALF_N, _gemm1_rows128


def _engine_gemm1(*, spec, host, weights, aligned, xq, xs, h, hs, stages: int) -> None:
    """The engine's GEMM1 exactly as `wgmma_fp8_moe` launches it."""
    from moekit.kernels.triton._details.codes import ACT_SILU

    s13 = weights.w13_scale
    host._gluon_hopper().gemm1[(aligned.max_blocks * (spec.I // host.TILE_N),)](
        x_desc=host._fp8_rows(xq, host.GEMM1_ROWS),
        w_desc=host._fp8_rows(weights.w13.reshape(-1, spec.H), host.TILE_N),
        x_scale_ptr=xs, w_scale_ptr=s13, h_ptr=h, h_scale_ptr=hs, block_expert_ptr=aligned.block_expert,
        num_blocks_ptr=aligned.num_valid_blocks, num_pid_m=aligned.max_blocks, stride_xsm=xs.stride(0),
        **host.block_scale_strides(s13), stride_hm=h.stride(0),
        stride_hsm=hs.stride(0), HIDDEN=spec.H, INTER_SIZE=spec.I, ACTIVATION=ACT_SILU.value, ALPHA=0.0,
        HAS_LIMIT=False, LIMIT=0.0, GROUP_M=8, NUM_STAGES=stages, MATH_REGISTERS=host.MATH_REGISTERS,
        LOAD_REGISTERS=host.LOAD_REGISTERS, num_warps=4,
    )  # fmt: skip


def _prototype_gemm1(*, spec, host, weights, aligned, blocks, xq, xs, h32, stages: int) -> tuple:
    """The prototype's GEMM1 into h32, then h's FP8 codes and scales by the layer's row quantization."""
    from moekit.kernels.triton._details.codes import ACT_SILU
    from moekit.kernels.triton.launch import _quantize_rows
    from moekit.spec import ActivationQuant

    s13 = weights.w13_scale
    _gemm1_rows128[(blocks.max_blocks * (spec.I // HALF_N.value),)](
        x_desc=host._fp8_rows(xq, 2 * host.GEMM1_ROWS),
        w_desc=host._fp8_rows(weights.w13.reshape(-1, spec.H), HALF_N.value),
        x_scale_ptr=xs, w_scale_ptr=s13, h_ptr=h32, block_expert_ptr=blocks.block_expert,
        block_start_ptr=blocks.block_start, num_blocks_ptr=blocks.num_valid_blocks,
        expert_end_ptr=aligned.expert_offsets, num_pid_m=blocks.max_blocks, stride_xsm=xs.stride(0),
        **host.block_scale_strides(s13), stride_hm=h32.stride(0),
        HIDDEN=spec.H, INTER_SIZE=spec.I, ACTIVATION=ACT_SILU.value, GROUP_M=8, NUM_STAGES=stages,
        MATH_REGISTERS=host.MATH_REGISTERS, LOAD_REGISTERS=host.LOAD_REGISTERS, num_warps=4,
    )  # fmt: skip
    return _quantize_rows(h32, quant=ActivationQuant.FP8_PER_GROUP_128)


def _reference_h(layer, spec, xq, xs, aligned, rows):
    """fp32 h of the sorted `rows` from the dequantized FP8 x rows and weights (`expert_hidden`)."""
    import torch

    from moekit.reference import expert_hidden

    x = xq[rows].float() * xs[rows].repeat_interleave(128, dim=1)
    experts = torch.repeat_interleave(
        torch.arange(spec.E_local, device=xq.device), aligned.expert_offsets.diff()
    )[rows]
    h = torch.empty(rows.numel(), spec.I, dtype=torch.float32, device=xq.device)
    for e in experts.unique().tolist():
        sel = (experts == e).nonzero().squeeze(1)
        h[sel] = expert_hidden(x[sel], layer.weights, e, spec=spec)
    return h


def run(preset_name: str, token_counts: list[int], stage_counts: list[int]) -> int:
    import torch

    from moekit.app.bench import flushed_seconds
    from moekit.kernels.triton import wgmma_fp8 as host
    from moekit.kernels.triton.align import align_routing, paired_blocks
    from moekit.ops import route
    from moekit.presets import preset_at
    from moekit.reference import relative_l2_error
    from moekit.synthetic import random_batch, random_layer

    device = torch.device("cuda")
    spec = preset_at(preset_name)
    reason = host.wgmma_fp8_reason(spec)
    if reason is not None:
        raise SystemExit(f"{preset_name}: the WGMMA_FP8 engine does not take it: {reason}")
    layer = random_layer(spec, seed=0, device=device)
    weights = layer.weights
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    for t in token_counts:
        x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
        routing = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias)
        aligned = align_routing(routing.ids, num_local_experts=spec.E_local, block_m=host.GEMM1_ROWS)
        blocks = paired_blocks(aligned)
        xq, xs = host._sorted_fp8_rows(x, aligned, spec=spec)
        rows_total = xq.shape[0]
        rows = (aligned.sorted_pair_ids[:rows_total] < aligned.num_pairs).nonzero().squeeze(1)
        expected = _reference_h(layer, spec, xq, xs, aligned, rows)
        flops = 2.0 * t * spec.K * 2 * spec.I * spec.H
        for stages in stage_counts:
            h = torch.full((rows_total, spec.I), float("nan"), device=device).to(torch.float8_e4m3fn)
            hs = torch.full((rows_total, spec.I // 128), float("nan"), device=device)
            h32 = torch.full((rows_total, spec.I), float("nan"), device=device)
            common = dict(spec=spec, host=host, weights=weights, aligned=aligned, xq=xq, xs=xs, stages=stages)
            engine = functools.partial(_engine_gemm1, h=h, hs=hs, **common)
            proto = functools.partial(_prototype_gemm1, blocks=blocks, h32=h32, **common)
            engine()
            hq2, hs2 = proto()
            torch.cuda.synchronize(device)
            codes_differ = (h[rows].view(torch.uint8) != hq2[rows].view(torch.uint8)).float().mean().item()
            engine_h = h[rows].float() * hs[rows].repeat_interleave(128, 1)
            proto_h = hq2[rows].float() * hs2[rows].repeat_interleave(128, 1)
            nan_rows = int(h32[rows].isnan().any(1).sum())
            engine_us = flushed_seconds(engine, device, flush, repeats=10) * 1e6
            proto_us = flushed_seconds(proto, device, flush, repeats=10) * 1e6
            print(
                f"T={t}, {stages} stages: engine GEMM1 {engine_us:.1f} us "
                f"({flops / engine_us / 1e6:.0f} TFLOP/s); prototype + h quantization {proto_us:.1f} us "
                f"({flops / proto_us / 1e6:.0f}); engine / prototype "
                f"{engine_us / proto_us:.3f}. Prototype h: rel L2 "
                f"{relative_l2_error(h32[rows], expected):.2e} vs torch, "
                f"{relative_l2_error(proto_h, engine_h):.2e} vs the engine's dequantized h, "
                f"FP8 codes differing {codes_differ:.2e}, NaN rows {nan_rows}",
                flush=True,
            )  # fmt: skip
    return 0

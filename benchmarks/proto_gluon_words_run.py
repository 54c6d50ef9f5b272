"""The GPU half of benchmarks/proto_gluon_words.py: per T, the layer's own GEMM1 and GEMM2 times (a
profiled graph replay) and, per tile, each prototype GEMM's output (NaN-poisoned first) against the
dequantized reference and its time (graph replay, L2 flushed, as `flushed_seconds` measures).

Data flow: preset layer -> the layer's plan and prepared weights (MXFP4_MMA_WORDS) -> routing ->
`_reference_pairs` (fp32 h from the dequantized w13, and y from that h in bf16, as GEMM2 reads it) ->
`align_routing(block_m)` -> `_launch` / `_launch2` -> rel L2 and µs, printed.
"""

from __future__ import annotations

import functools

from proto_gluon_words import NUM_WARPS, W_ROWS, _gemm1, _gemm2


def _shipped_gemm_us(chosen, layer, weights, x, logits, flush, repeats: int = 10) -> dict[int, float]:
    """GPU time of the layer's own GEMM1 and GEMM2 kernels per layer (profiled graph replay, L2 flushed
    before each layer), as benchmarks/profile_stages.py measures stages."""
    from moekit.app.bench import profiled_kernels, whole_layer

    layer_fn = whole_layer(chosen, layer, weights, x, logits)
    kernels = profiled_kernels(layer_fn, x.device, flush, repeats=repeats)
    return {g: sum(us for name, us in kernels if f"_moe_gemm{g}" in name) for g in (1, 2)}


def _reference_pairs(layer, spec, x, routing):
    """fp32 h [T*K, I] and y [T*K, H] in pair order from the dequantized weights (`moekit.reference`'s
    per-expert steps): h = act(x[p // K] @ w13[e]^T + b13[e]); y from h in bf16, as GEMM2 reads it,
    times the router weight."""
    import torch

    from moekit.reference import expert_hidden, expert_output

    flat, route_w = routing.ids.reshape(-1), routing.weights.reshape(-1).float()
    h = torch.empty(flat.numel(), spec.I, dtype=torch.float32, device=x.device)
    y = torch.empty(flat.numel(), spec.H, dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        h[pairs] = expert_hidden(x[pairs // spec.K].float(), layer.weights, e, spec=spec)
        y[pairs] = expert_output(h[pairs].bfloat16().float(), layer.weights, e) * route_w[pairs, None]
    return h, y


def _launch(*, spec, x, weights, aligned, h, block_m: int, stages: int, maxnreg: int | None) -> None:
    """`_gemm1` on the alignment's blocks into h."""
    from moekit.kernels.triton._details.codes import ACT_SWIGLU_OAI

    act = spec.activation
    _gemm1[(aligned.max_blocks * (2 * spec.I // W_ROWS),)](
        x, weights.w13, weights.w13_scale, weights.b13, aligned.sorted_pair_ids, aligned.block_expert,
        aligned.num_valid_blocks, h, aligned.num_pairs, aligned.max_blocks, x.stride(0), h.stride(0),
        HIDDEN=spec.H, INTER_SIZE=spec.I, TOP_K=spec.K, ACTIVATION=ACT_SWIGLU_OAI.value, ALPHA=act.alpha,
        HAS_LIMIT=act.limit is not None, LIMIT=0.0 if act.limit is None else act.limit,
        BLOCK_M=block_m, STAGES=stages, GROUP_M=8, num_warps=NUM_WARPS,
        **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )  # fmt: skip


def _launch2(
    *, spec, h, weights, route_w, aligned, y, block_m: int, stages: int, maxnreg: int | None
) -> None:
    """`_gemm2` on the alignment's blocks into y (`route_w`: fp32 [T*K] router weights)."""
    _gemm2[(aligned.max_blocks * -(-spec.H // W_ROWS),)](
        h, weights.w2, weights.w2_scale, weights.b2, route_w,
        aligned.sorted_pair_ids, aligned.block_expert, aligned.num_valid_blocks, y, aligned.num_pairs,
        aligned.max_blocks, h.stride(0), y.stride(0),
        HIDDEN=spec.H, INTER_SIZE=spec.I, BLOCK_M=block_m, STAGES=stages, GROUP_M=8, num_warps=NUM_WARPS,
        **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )  # fmt: skip


def run(
    preset_name: str, token_counts: list[int], tiles: list[tuple[int, int]], caps: dict[int, int | None]
) -> int:
    """Each T: the layer's GEMM times; each tile: both prototype GEMMs' outputs (NaN-poisoned first)
    against the reference, and their times (graph replay, L2 flushed, as `flushed_seconds` measures).
    `caps`: ptxas's register cap per BLOCK_M."""
    import torch

    from moekit.app.bench import flushed_seconds, prepared_weights
    from moekit.kernels.base import DeviceInfo
    from moekit.kernels.triton.align import align_routing
    from moekit.ops import route
    from moekit.planning.plan import plan
    from moekit.presets import preset_at
    from moekit.reference import relative_l2_error
    from moekit.spec import GateLayout, WeightFormat
    from moekit.synthetic import random_batch, random_layer
    from moekit.weights import WeightPacking

    device = torch.device("cuda")
    spec = preset_at(preset_name)
    if spec.weight_format is not WeightFormat.MXFP4 or spec.gate_layout is not GateLayout.INTERLEAVED:
        raise SystemExit(f"the prototype runs MXFP4 layers with INTERLEAVED gate/up rows, got {spec}")
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)
    cache: dict = {}
    for t in token_counts:
        chosen = plan(spec, num_tokens=t, device=info)
        weights = prepared_weights(chosen, layer, cache)
        assert weights.packing is WeightPacking.MXFP4_MMA_WORDS, weights.packing
        x, logits, _ = random_batch(spec, t, correction_bias=layer.correction_bias, seed=t, device=device)
        shipped = _shipped_gemm_us(chosen, layer, weights, x, logits, flush)
        routing = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias)
        h_expected, y_expected = _reference_pairs(layer, spec, x, routing)
        h_in = h_expected.to(torch.bfloat16)  # GEMM2's input: the reference h, as the layer stores h
        route_w = routing.weights.reshape(-1).float().contiguous()
        flops = 2.0 * t * spec.K * spec.I * spec.H  # one GEMM2; GEMM1 is twice that
        print(
            f"T={t}: layer's GEMM1 {shipped[1]:.1f} us ({2 * flops / shipped[1] / 1e6:.0f} TFLOP/s), "
            f"GEMM2 {shipped[2]:.1f} us ({flops / shipped[2] / 1e6:.0f}); config {chosen.config.as_dict()}",
            flush=True,
        )
        for block_m, stages in tiles:
            aligned = align_routing(routing.ids, num_local_experts=spec.E_local, block_m=block_m)
            h = torch.full((t * spec.K, spec.I), float("nan"), dtype=torch.bfloat16, device=device)
            y = torch.full((t * spec.K, spec.H), float("nan"), dtype=torch.bfloat16, device=device)
            tile = dict(aligned=aligned, block_m=block_m, stages=stages, maxnreg=caps[block_m])
            gemm1 = functools.partial(_launch, spec=spec, x=x, weights=weights, h=h, **tile)
            gemm2 = functools.partial(
                _launch2, spec=spec, h=h_in, weights=weights, route_w=route_w, y=y, **tile
            )
            for name, launch, out, expected, shipped_us, work in (
                ("GEMM1", gemm1, h, h_expected, shipped[1], 2 * flops),
                ("GEMM2", gemm2, y, y_expected, shipped[2], flops),
            ):
                launch()
                torch.cuda.synchronize(device)
                error = relative_l2_error(out.float(), expected)
                nan_rows = int(out.isnan().any(dim=1).sum())
                us = flushed_seconds(launch, device, flush, repeats=20) * 1e6
                rate = work / us / 1e6
                print(
                    f"   {name} block_m {block_m}, {stages} stages: {us:.1f} us ({rate:.0f} TFLOP/s), "
                    f"layer / prototype {shipped_us / us:.3f}; rel L2 {error:.2e}, rows with NaN {nan_rows}",
                    flush=True,
                )
    return 0

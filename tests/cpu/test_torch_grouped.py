"""The unfused PyTorch kernel (`torch_grouped`, the plan's kernel on the CPU) at the edges of its math,
against `moekit.fused_moe_reference`.

Data flow per case: a small spec -> `random_layer` -> `plan(device="cpu")` / `prepare_weights` / `fused_moe`
with routing given by hand -> compared with the reference on the same inputs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from moekit import MoESpec, RoutingResult, WeightFormat, fused_moe, fused_moe_reference, plan, prepare_weights
from moekit.reference import relative_l2_error, tolerance
from moekit.synthetic import random_layer


def test_pairs_of_other_ranks_add_zero_even_where_a_local_expert_overflows() -> None:
    # fp16 GEMMs: local expert 0 overflows to inf on these large tokens. Tokens 0 and 1 are routed only to
    # experts of another rank (-1 in the map), so they must get zero rows, as in the reference, whatever
    # any local expert would have made of them; token 2 runs on local expert 1 as usual.
    spec = MoESpec(
        num_experts=4,
        top_k=1,
        hidden_size=64,
        intermediate_size=32,
        weight_format=WeightFormat.FP16,
        act_dtype=torch.float16,
        num_local_experts=2,
    )
    layer = random_layer(spec, seed=0)
    w13 = layer.weights.w13.clone()
    w13[0] *= 3000
    weights = replace(layer.weights, w13=w13)
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    x = (30 * torch.randn(3, spec.H, generator=gen)).half()
    routing = RoutingResult(
        weights=torch.rand(3, 1, generator=gen) + 0.5, ids=torch.tensor([[2], [3], [1]], dtype=torch.int32)
    )
    p = plan(spec, num_tokens=3, device="cpu")
    assert p.kernel == "torch_grouped"
    got = fused_moe(x, prepare_weights(weights, p), routing, plan=p, expert_map=expert_map)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    assert torch.equal(got[:2], torch.zeros_like(got[:2])), "a pair of another rank reached the output"
    assert expected[2].abs().sum() > 0
    assert relative_l2_error(got, expected) <= tolerance(spec)

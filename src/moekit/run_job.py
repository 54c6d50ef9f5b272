"""The main job (`moekit run`): build a layer, route random tokens, run it, time it, self-check it.

Data flow: preset name or checkpoint layer -> (spec, weights, router) -> route(x @ router^T) ->
the chosen path (the reference on a CPU) -> timing and a self-check against an independent spelling
of the math (`fused_moe_per_token_loop`, float64) on a few tokens -> a `RunReport`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.presets import DEFAULT_PRESET, preset
from moekit.reference import fused_moe_per_token_loop, fused_moe_reference, relative_l2_error
from moekit.routing import RoutingResult, route
from moekit.spec import MoESpec
from moekit.synthetic import random_layer, random_tokens
from moekit.weights import ExpertWeights

# Reference vs the float64 per-token loop: both accumulate in >= fp32 from the same dequantized
# weights; the only difference is the final cast to the activation dtype (bf16: 2^-8 relative).
SELF_CHECK_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class RunReport:
    source: str  # "preset gpt-oss-20b (random weights, seed 0)" or the checkpoint path and layer
    spec: MoESpec
    device: str
    path: str  # what computed the layer
    num_tokens: int
    experts_hit: int
    seconds: float
    check_tokens: int
    check_rel_l2: float
    check_tolerance: float

    @property
    def check_passed(self) -> bool:
        return self.check_rel_l2 <= self.check_tolerance

    def as_dict(self) -> dict:
        return {
            "source": self.source, "spec": self.spec.describe(), "device": self.device, "path": self.path,
            "num_tokens": self.num_tokens, "experts_hit": self.experts_hit, "seconds": self.seconds,
            "check_tokens": self.check_tokens, "check_rel_l2": self.check_rel_l2,
            "check_tolerance": self.check_tolerance, "check_passed": self.check_passed,
        }


@dataclass(frozen=True)
class _Layer:
    source: str
    spec: MoESpec
    weights: ExpertWeights
    router_weight: torch.Tensor
    router_bias: torch.Tensor | None
    correction_bias: torch.Tensor | None


def _load_layer(*, preset_name: str, checkpoint: Path | None, layer: int, seed: int) -> _Layer:
    if checkpoint is not None:
        from moekit.checkpoint import load_gpt_oss_layer

        loaded = load_gpt_oss_layer(checkpoint, layer=layer)
        return _Layer(f"checkpoint {checkpoint} layer {layer} ({loaded.naming.name} naming)", loaded.spec_for(),
                      loaded.weights, loaded.router_weight, loaded.router_bias, None)
    spec = preset(preset_name)
    synthetic = random_layer(spec, seed=seed)
    return _Layer(f"preset {preset_name} (random weights, seed {seed})", spec, synthetic.weights,
                  synthetic.router_weight, None, synthetic.correction_bias)


def run_job(
    *,
    preset_name: str = DEFAULT_PRESET,
    checkpoint: Path | None = None,
    layer: int = 0,
    num_tokens: int = 4,
    seed: int = 0,
    check_tokens: int = 2,
) -> RunReport:
    loaded = _load_layer(preset_name=preset_name, checkpoint=checkpoint, layer=layer, seed=seed)
    spec = loaded.spec
    x = random_tokens(spec, num_tokens, seed=seed + 1)
    logits = x.float() @ loaded.router_weight.float().T
    if loaded.router_bias is not None:
        logits = logits + loaded.router_bias.float()
    routing = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=loaded.correction_bias)
    start = time.perf_counter()
    out = fused_moe_reference(x, loaded.weights, routing, spec=spec)
    seconds = time.perf_counter() - start
    n_check = min(check_tokens, num_tokens)
    sub = RoutingResult(weights=routing.weights[:n_check], ids=routing.ids[:n_check])
    expected = fused_moe_per_token_loop(x[:n_check], loaded.weights, sub, spec=spec)
    rel = relative_l2_error(out[:n_check], expected) if n_check else 0.0
    return RunReport(
        source=loaded.source, spec=spec, device=str(x.device), path="reference (PyTorch, fp32 accumulation)",
        num_tokens=num_tokens, experts_hit=int(routing.ids.unique().numel()), seconds=seconds,
        check_tokens=n_check, check_rel_l2=rel, check_tolerance=SELF_CHECK_TOLERANCE[spec.act_dtype],
    )

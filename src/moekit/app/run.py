"""The main job (`moekit run`): build a layer, plan it, route random tokens, run, time and self-check it.

Data flow: preset name or checkpoint layer -> (spec, weights, router) -> `plan` for this device ->
`prepare_weights` (load time) -> route(x @ router^T) -> `fused_moe` with the chosen kernel -> timing ->
self-check against the fp32 reference (or, when the reference itself ran, against the next capable
kernel: the oracle cannot check itself) -> a `RunReport`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.app.timing import median_seconds
from moekit.checkpoint import load_gpt_oss_layer, load_hf_moe_layer, per_expert_family
from moekit.checkpoint.hf_config import CONFIG_FILE
from moekit.errors import ShapeError, check_int
from moekit.kernels.registry import default_registry
from moekit.ops import fused_moe, prepare_weights, route
from moekit.planning.plan import Plan, plan
from moekit.presets import DEFAULT_PRESET, preset
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
from moekit.spec import MoESpec
from moekit.synthetic import random_layer, random_tokens
from moekit.weights import ExpertWeights


@dataclass(frozen=True)
class RunReport:
    source: str  # "preset gpt-oss-20b (random weights, seed 0)" or the checkpoint path and layer
    spec: MoESpec
    device: str
    plan: Plan
    num_tokens: int
    experts_hit: int
    prepare_seconds: float  # one-time load step (e.g. dequantize for the unfused path)
    packing: str  # WeightPacking the kernel reads after that step
    seconds: float  # one forward
    check_against: str
    check_tokens: int
    check_rel_l2: float
    check_tolerance: float

    @property
    def check_passed(self) -> bool:
        return self.check_rel_l2 <= self.check_tolerance

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "spec": self.spec.describe(),
            "device": self.device,
            "kernel": self.plan.kernel,
            "config": self.plan.config.as_dict(),
            "config_source": self.plan.source.name,
            "num_tokens": self.num_tokens,
            "experts_hit": self.experts_hit,
            "prepare_seconds": self.prepare_seconds,
            "packing": self.packing,
            "seconds": self.seconds,
            "check_against": self.check_against,
            "check_tokens": self.check_tokens,
            "check_rel_l2": self.check_rel_l2,
            "check_tolerance": self.check_tolerance,
            "check_passed": self.check_passed,
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
    # A .safetensors file of a per-expert model takes its folder's config.json (not the GPT-OSS loader,
    # whose missing-tensor list would name tensors the model never had).
    folder = checkpoint.parent if checkpoint is not None and checkpoint.is_file() else checkpoint
    if folder is not None and per_expert_family(folder) is not None:
        config = folder / CONFIG_FILE if folder != checkpoint else None
        hf = load_hf_moe_layer(checkpoint, layer=layer, config=config)
        source = f"checkpoint {checkpoint} layer {layer} ({hf.family.value}, routed experts only)"
        return _Layer(source, hf.spec, hf.weights, hf.router_weight, None, hf.correction_bias)
    if checkpoint is not None:
        loaded = load_gpt_oss_layer(checkpoint, layer=layer)
        return _Layer(
            f"checkpoint {checkpoint} layer {layer} ({loaded.naming.name} naming)",
            loaded.spec_for(),
            loaded.weights,
            loaded.router_weight,
            loaded.router_bias,
            None,
        )
    spec = preset(preset_name)
    synthetic = random_layer(spec, seed=seed)
    return _Layer(
        f"preset {preset_name} (random weights, seed {seed})",
        spec,
        synthetic.weights,
        synthetic.router_weight,
        None,
        synthetic.correction_bias,
    )


def run_job(
    *,
    preset_name: str = DEFAULT_PRESET,
    checkpoint: Path | None = None,
    layer: int = 0,
    num_tokens: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> RunReport:
    """Build the layer, plan it for `device`, run and time the chosen kernel, check it against the
    reference."""
    check_int("run_job(num_tokens)", num_tokens, minimum=1, error=ShapeError)  # 0 tokens would check nothing
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    loaded = _load_layer(preset_name=preset_name, checkpoint=checkpoint, layer=layer, seed=seed)
    spec = loaded.spec
    chosen = plan(spec, num_tokens=num_tokens, device=dev)
    begin = time.perf_counter()
    weights = prepare_weights(loaded.weights.to(dev), chosen)
    prepare_seconds = time.perf_counter() - begin
    packing = weights.packing.name
    x = random_tokens(spec, num_tokens, seed=seed + 1).to(dev)
    logits = x.float() @ loaded.router_weight.to(dev).float().T
    if loaded.router_bias is not None:
        logits = logits + loaded.router_bias.to(dev).float()
    correction = None if loaded.correction_bias is None else loaded.correction_bias.to(dev)
    routing = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=correction)
    out = fused_moe(x, weights, routing, plan=chosen)
    seconds = median_seconds(
        lambda: fused_moe(x, weights, routing, plan=chosen),
        dev,
        **(dict(repeats=20) if dev.type == "cuda" else dict(repeats=1, batches=3, warmup=1)),  # a CPU is slow
    )
    if chosen.kernel == "reference":  # the oracle cannot check itself: the next capable kernel checks it
        other = plan(
            spec, num_tokens=num_tokens, device=dev, registry=default_registry().without("reference")
        )
        expected = fused_moe(x, prepare_weights(loaded.weights.to(dev), other), routing, plan=other)
        against = f"{other.kernel} kernel"
    else:
        expected = fused_moe_reference(x, loaded.weights.to(dev), routing, spec=spec)
        against = "fp32 reference"
    n_check, rel = num_tokens, relative_l2_error(out, expected)
    return RunReport(
        source=loaded.source,
        spec=spec,
        device=str(dev),
        plan=chosen,
        num_tokens=num_tokens,
        experts_hit=int(routing.ids.unique().numel()),
        prepare_seconds=prepare_seconds,
        packing=packing,
        seconds=seconds,
        check_against=against,
        check_tokens=n_check,
        check_rel_l2=rel,
        check_tolerance=tolerance(spec),
    )

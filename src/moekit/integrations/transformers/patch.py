"""Hugging Face transformers: swap the MoE blocks of GPT-OSS, Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE,
DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, dots1 and MiniMax-M2 models for moekit layers.

Data flow (which classes are blocks, where their router sits and what they return: `families.FAMILIES`):
  patch_model(model): every module whose class is a supported block (`family_of`) -> `hf_layer_of`
    (`convert.from_hf_moe_block` with the config fields read off the module: sizes, top-k, clamp,
    activation by evaluation, DeepSeek-V3's n_group / topk_group / routed_scaling_factor /
    norm_topk_prob) -> spec + `ExpertWeights` in the block's own gate layout and dtype (one copy of the
    experts; DeepSeek-V3's correction bias copied from the router's buffer) -> `FusedMoE` on the experts'
    device (planned now: an unsupported spec raises, and blocks already swapped are put back) -> a
    `MoekitMoEBlock` that keeps the HF router module (and shared-expert modules) under their original
    names and takes the block's place in its parent.
  `MoekitMoEBlock` (`block`): forward through the HF router and `FusedMoE`; the original experts' storage
    released once a bit-exact inverse is checked; saved, loaded and cast as the original block would be.
  patch_model(model, parallel=...) / fused_moe_from_hf(block, parallel=...): each layer this rank's share
    of a tensor- or expert-parallel group (`moekit.Parallel`); the original experts are then kept.
  patch_model also guards casts on every module above a patched block (`block.guard_casts`): a refused
    `.half()` / `.to(dtype)` raises before any tensor of the model changes.
  unpatch(model): every `MoekitMoEBlock` is replaced by its original block, experts restored, guards removed.

Saving: `model.state_dict()` / `save_pretrained` of a patched model hold the same names and values as
the unpatched model's (the experts rebuilt from moekit's weights), so the checkpoint reloads without
moekit. Casting: the dtypes belong to the moekit spec, as a model's dtype does in vLLM or SGLang once it
is loaded: `.half()` / `.to(dtype)` on a patched model raise `DTypeError` and leave every tensor as it
was; cast before patching, or unpatch, cast and patch again. Device moves (`.to("cpu")`, `.cuda()`) work
and plan again on the new device; a device moekit cannot run on is refused the same way, changing nothing.

Patched blocks serve inference: the moekit op has no autograd formula, and Mixtral's training-time
router jitter is not applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from moekit.errors import ArgumentError, SpecError, check_bool, check_type
from moekit.integrations.transformers.block import MoekitMoEBlock, guard_casts, unguard_casts
from moekit.integrations.transformers.convert import HfMoeLayer, from_hf_moe_block
from moekit.integrations.transformers.families import Family, block_class_names, family_of
from moekit.integrations.transformers.held import held_config_fields, hidden_act_of
from moekit.layer import FusedMoE, PlanOptions
from moekit.parallel import Parallel
from moekit.parallel.build import refused_in_construction
from moekit.spec import MoESpec


def _config_of_module(module: torch.nn.Module, family: Family, *, config: object | None) -> SimpleNamespace:
    """The config fields `convert.spec_from_hf_config` reads, taken from the block itself.

    The module is the truth of what it computes (transformers versions differ in which config fields
    exist: 5.17's GptOssConfig has no `swiglu_limit`, its experts hold `limit`); `config`, if given, is
    only consulted for an activation the probe does not recognize."""
    hf = family.hf
    experts, router = module.experts, getattr(module, hf.router_name)
    gate_up = experts.gate_up_proj  # [E, H, 2I] if transposed, else [E, 2I, H]
    held = held_config_fields(module, family)
    if "num_experts_per_tok" not in held:
        raise SpecError(f"{type(router).__name__} has no `top_k` attribute: the block's top-k is unknown")
    fields = {
        "model_type": family.value,
        "num_experts_per_tok": held["num_experts_per_tok"],
        "hidden_size": router.weight.shape[1],
        hf.num_experts_field: gate_up.shape[0],
        hf.intermediate_field: gate_up.shape[2 if hf.gate_up_transposed else 1] // 2,
    }
    if hf.swiglu is not None:
        if hf.swiglu.config_limit not in held:
            raise SpecError(f"{type(experts).__name__} has no `limit` attribute: its SwiGLU clamp is unknown")
        # A missing alpha stays None: convert then applies the alpha of versions that hard-code it.
        fields[hf.swiglu.config_alpha] = held.get(hf.swiglu.config_alpha)
        fields[hf.swiglu.config_limit] = held[hf.swiglu.config_limit]
    elif "hidden_act" in held:
        fields["hidden_act"] = held["hidden_act"]
    else:
        if getattr(config, "hidden_act", None) is None:
            hidden_act_of(experts.act_fn)  # raises the probe's SpecError, which names the activation
        fields["hidden_act"] = config.hidden_act  # convert refuses names without a moekit activation
    if hf.renormalize_field is not None:  # the router holds the flag under the config's name
        if hf.renormalize_field not in held:
            raise SpecError(
                f"{type(router).__name__} has no `{hf.renormalize_field}` attribute: whether the block "
                "renormalizes its top-k weights is unknown"
            )
        fields[hf.renormalize_field] = held[hf.renormalize_field]
    missing = [f"{attribute} ({field})" for attribute, field in hf.router_fields if field not in held]
    if missing:
        raise SpecError(f"{type(router).__name__} has no {missing}: the block's routing is unknown")
    fields |= {field: held[field] for _, field in hf.router_fields}
    return SimpleNamespace(**fields)


def _config_for(config: object | None, family: Family) -> object | None:
    """`config` if it (or its text config) is of `family`'s model type; None if no config was given."""
    if config is None:
        return None
    for candidate in (config, getattr(config, "get_text_config", lambda: None)()):
        if getattr(candidate, "model_type", None) == family.value:
            return candidate
    raise SpecError(
        f"config has model_type {getattr(config, 'model_type', None)!r} but the block is "
        f"{family.value}; pass the config of the model that holds the block (or none)"
    )


def hf_layer_of(module: torch.nn.Module, *, config: object | None = None) -> HfMoeLayer:
    """An HF MoE block -> moekit spec, expert weights (native gate layout and dtype) and router tensors."""
    family = family_of(module)
    if family is None:
        raise SpecError(
            f"{type(module).__name__} is not a supported Hugging Face MoE block; "
            f"supported: {block_class_names()}"
        )
    cfg = _config_of_module(module, family, config=_config_for(config, family))
    return from_hf_moe_block(module, config=cfg)


def fused_moe_from_hf(
    module: torch.nn.Module,
    *,
    config: object | None = None,
    device: torch.device | str | None = None,
    options: PlanOptions | None = None,
    parallel: Parallel | None = None,
) -> FusedMoE:
    """A `FusedMoE` of the routed experts of a Hugging Face GptOssMLP / MixtralSparseMoeBlock /
    Qwen2MoeSparseMoeBlock / Qwen3MoeSparseMoeBlock / DeepseekV3MoE (with DeepSeek-V3's correction bias).
    A block's shared experts are not in it: the caller adds them (`patch_model` does).

    `config` (the model's config) may be omitted: sizes, top-k and activation are read off the module.
    The experts are copied once into moekit's layout; the module itself is left untouched. `parallel`
    (`moekit.Parallel.tensor` / `.expert`): the layer holds this rank's share (`FusedMoE(parallel=)`).
    """
    with refused_in_construction(parallel):  # a rank refusing its block: its peers raise too
        hf = hf_layer_of(module, config=config)
    return FusedMoE(
        spec=hf.spec,
        weights=hf.weights,
        router_weight=hf.router_weight,
        router_bias=hf.router_bias,
        correction_bias=hf.correction_bias,
        device=device,
        options=options,
        parallel=parallel,
    )


@dataclass(frozen=True)
class PatchedBlock:
    name: str  # module path in the model, e.g. "model.layers.0.mlp"
    family: Family
    spec: MoESpec
    kernel: str  # the kernel of the token-bucket-1 plan
    released_original: bool  # the HF experts' storage was freed (unpatch rebuilds it)


@dataclass(frozen=True)
class PatchReport:
    blocks: tuple[PatchedBlock, ...]

    def explain(self) -> str:
        lines = [f"moekit patched {len(self.blocks)} MoE block(s):"]
        lines += [
            f"  {b.name}: {b.family.value} -> {b.kernel} ({b.spec.describe()})"
            + ("" if b.released_original else " [original experts kept]")
            for b in self.blocks
        ]
        return "\n".join(lines)


_MODEL_FIX = "pass the loaded model (a torch.nn.Module, e.g. from AutoModelForCausalLM.from_pretrained)"


def _set_submodule(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def patch_model(
    model: torch.nn.Module,
    *,
    options: PlanOptions | None = None,
    release_originals: bool = True,
    parallel: Parallel | None = None,
) -> PatchReport:
    """Replace every supported (`Family`) MoE block of `model` with a
    moekit-backed block (shared experts run by the block's own HF modules, added to moekit's output).

    Each layer is built on its experts' device with their dtype. `release_originals=False` keeps the
    original experts' storage too (twice the expert memory). If any block fails to plan, the blocks
    already patched are restored before the error propagates.

    `parallel` (`moekit.Parallel.tensor(group)` / `.expert(group)`, called on every rank of the group):
    each moekit layer holds this rank's share and every rank's block gives its own tokens' full output
    (tensor: the same tokens on every rank, one all-reduce inside the layer; expert: each rank its own
    tokens, every rank calling every block each forward). The original experts are kept (a share cannot
    rebuild them), so `state_dict` and `unpatch` give the whole model back. Shared experts run whole on
    every rank, on its own tokens, and are added after the layer's output is complete (after a
    tensor-parallel layer's all-reduce), so they count once.
    """
    check_type("patch_model(model=...)", model, torch.nn.Module, fix=_MODEL_FIX)
    check_bool("patch_model(release_originals=...)", release_originals, error=ArgumentError)
    if any(isinstance(m, MoekitMoEBlock) for m in model.modules()):
        raise SpecError(f"{type(model).__name__} is already patched by moekit; call unpatch(model) first")
    targets = [(name, m, family_of(m)) for name, m in model.named_modules()]
    targets = [(name, m, f) for name, m, f in targets if f is not None]
    if not targets:
        raise SpecError(f"no Hugging Face MoE block ({block_class_names()}) found in {type(model).__name__}")
    if any(name == "" for name, _, _ in targets):
        raise SpecError(
            "the model is itself an MoE block: patch the model holding it, or use "
            "moekit.integrations.transformers.fused_moe_from_hf(block)"
        )
    config = getattr(model, "config", None)
    done: list[PatchedBlock] = []
    try:
        for name, block, family in targets:
            with refused_in_construction(parallel):  # a rank refusing its block: its peers raise too
                hf = hf_layer_of(block, config=config)
            router = getattr(block, family.router_name)
            # The FusedMoE aliases the HF router's weight and bias (no copy; the wrapper calls the HF router
            # anyway); the correction bias is a copy read now (and again by a load_state_dict of the block).
            moe = FusedMoE(
                spec=hf.spec,
                weights=hf.weights,
                router_weight=router.weight,
                router_bias=getattr(router, "bias", None),
                correction_bias=hf.correction_bias,
                device=hf.weights.device,
                options=options,
                parallel=parallel,
            )
            wrapper = MoekitMoEBlock(original=block, family=family, moe=moe, spec=hf.spec)
            released = release_originals and wrapper.release_original()
            _set_submodule(model, name, wrapper)
            guard_casts(model, [name])
            done.append(
                PatchedBlock(
                    name=name,
                    family=family,
                    spec=hf.spec,
                    kernel=moe.plan_for(1).kernel,
                    released_original=released,
                )
            )
    except BaseException:
        unpatch(model)
        raise
    return PatchReport(blocks=tuple(done))


def unpatch(model: torch.nn.Module) -> int:
    """Put every original HF block back (experts rebuilt if released); returns how many were restored."""
    check_type("unpatch(model=...)", model, torch.nn.Module, fix=_MODEL_FIX)
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, MoekitMoEBlock)]
    for name, wrapper in found:
        _set_submodule(model, name, wrapper.restore_original())
    unguard_casts(model)
    return len(found)

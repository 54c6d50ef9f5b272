"""llm-compressor's FP8 checkpoints (`quant_method` "compressed-tensors"): what their `quantization_config`
says of one MoE layer's experts, mapped onto moekit's FP8 formats. Config only: no tensor is read here,
and moekit does not import compressed-tensors.

Data flow: quantization_config + the module names of one layer's expert projections ->
`compressed_tensors_experts` -> None (every projection in `ignore` or in no group's targets: float
experts, read as their dtype says) or an `ExpertQuantization`; anything moekit cannot compute exactly is
a CheckpointError naming the field.

Facts, read from compressed-tensors 0.20.1 (quantization/quant_args.py, quant_scheme.py, quant_config.py,
lifecycle/initialize.py, lifecycle/forward_helpers.py, compressors/naive_quantized/base.py,
compressors/format.py, utils/match.py, compressors/model_compressors/model_compressor.py):
- quantization_config holds `format`, `config_groups` {name: scheme}, `ignore` [...], and
  `quantization_status`, `kv_cache_scheme`, `sparsity_config`, `transform_config`, `version`. A scheme
  is {targets, weights, input_activations, output_activations, format}; each args object {num_bits,
  type "int" | "float" (default "int"), symmetric (default true), strategy, group_size, block_structure,
  dynamic (default false), ...}. A null strategy is group_size's: none -> "tensor", -1 -> "channel",
  > 0 -> "group".
- A target or `ignore` entry names a module exactly, or by a regex after "re:" (`re.match`: anchored at
  the start only), or by class ("Linear": the per-expert projections are nn.Linear modules when
  llm-compressor calibrates them).
- Each quantized projection stores `.weight` (float8_e4m3fn for 8-bit float, [out, in]) and
  `.weight_scale`: tensor [1], channel [out, 1], block [ceil(out/r), ceil(in/c)] for block_structure
  [r, c]; in the dtype the weights had before (bf16 for a bf16 model) unless `scale_dtype` says
  otherwise. value = code * scale. A symmetric scheme stores no zero point.
- Static input activations add `.input_scale`; dynamic ones store nothing and are scaled at run time
  per token ("token"), per group_size columns ("group") or per tensor ("tensor").
- The float-quantized compressor is chosen only when input activations are quantized; FP8 weights
  without them (W8A16) are written by the naive-quantized one, which stores the same codes and scales.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from moekit.checkpoint.hf_quant import CT_METHOD, WEIGHT_BLOCK_SIZE, ExpertQuantization, StoredScale
from moekit.errors import CheckpointError
from moekit.parallel.shard import FP8_BLOCK
from moekit.spec import ActivationQuant, Fp8Scale

CT_SCALE_SUFFIX = ".weight_scale"
_FORMATS = ("float-quantized", "naive-quantized")  # both store float8_e4m3fn codes and `.weight_scale`
_MIXED = "mixed-precision"  # the groups' own `format` fields say
_WHERE = "quantization_config"
_WEIGHT_SCALES = {
    "channel": StoredScale.CHANNEL,
    "tensor": StoredScale.TENSOR,
    "block": StoredScale.BLOCK_128,
}
_DYNAMIC_ACTS = {"token": ActivationQuant.FP8_PER_TOKEN, "group": ActivationQuant.FP8_PER_GROUP_128}


def _refuse(field: str, value: object, why: str) -> CheckpointError:
    return CheckpointError(f"{_WHERE}.{field}={value!r}: {why}")


def _matches(module: str, target: str) -> bool:
    """compressed-tensors' match of a projection by name, "re:" regex or class (nn.Linear)."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target in (module, "Linear")


def _strings(quant: Mapping[str, object], field: str) -> list[str]:
    value = quant.get(field)
    value = [] if value is None else value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(field, value, "must be a list of module names or 're:' patterns")
    return value


def _empty(quant: Mapping[str, object], field: str, why: str) -> None:
    if quant.get(field) not in (None, {}):
        raise _refuse(field, quant.get(field), why)


def _groups(quant: Mapping[str, object]) -> dict[str, Mapping[str, object]]:
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse("config_groups", groups, "must be an object of one or more quantization schemes")
    for name, scheme in groups.items():
        if not isinstance(scheme, Mapping):
            raise _refuse(
                f"config_groups.{name}", scheme, "must be a scheme object ({targets, weights, ...}), as "
                "llm-compressor saves it; a preset name's bare target list is not a saved config"
            )  # fmt: skip
    return dict(groups)


def _strategy(args: Mapping[str, object], field: str) -> str:
    """The args' strategy, lowercase, inferred from group_size when null (as QuantizationArgs does)."""
    strategy = args.get("strategy")
    if strategy is None:
        size = args.get("group_size")
        strategy = "tensor" if size is None else "channel" if size == -1 else "group"
    if not isinstance(strategy, str):
        raise _refuse(f"{field}.strategy", strategy, "must be a string")
    return strategy.lower()


def _check_fp8(args: Mapping[str, object], field: str) -> None:
    """8-bit float (E4M3), symmetric: the only compressed-tensors numbers moekit's FP8 format holds."""
    bits, kind = args.get("num_bits", 8), args.get("type", "int")
    if bits != 8 or isinstance(bits, bool):
        raise _refuse(f"{field}.num_bits", bits, "moekit reads 8-bit FP8 (E4M3) only")
    if not isinstance(kind, str) or kind.lower() != "float":
        raise _refuse(f"{field}.type", kind, "moekit reads 'float' (FP8 E4M3) only, not integer quantization")
    if args.get("symmetric", True) is not True:
        raise _refuse(f"{field}.symmetric", args.get("symmetric"), "moekit's FP8 has no zero point")


def _weight_scale(args: object, field: str) -> StoredScale:
    if not isinstance(args, Mapping):
        raise _refuse(
            field, args, "the experts' group must quantize their weights (FP8 weights, per channel, "
            "per tensor or in 128x128 blocks)"
        )  # fmt: skip
    _check_fp8(args, field)
    if args.get("dynamic", False) is not False:
        raise _refuse(f"{field}.dynamic", args.get("dynamic"), "weights must be stored quantized (static)")
    strategy = _strategy(args, field)
    stored = _WEIGHT_SCALES.get(strategy)
    if stored is None:
        raise _refuse(
            f"{field}.strategy", strategy,
            f"moekit's FP8 weights have one scale per output channel, per tensor or per 128x128 block "
            f"({sorted(_WEIGHT_SCALES)}); dequantize the experts and quantize them again with "
            "ExpertWeights.from_float",
        )  # fmt: skip
    if stored is StoredScale.BLOCK_128:
        block = args.get("block_structure")
        if isinstance(block, str):  # compressed-tensors still reads the old "RxC" spelling
            block = block.lower().split("x")
        shape = [int(b) for b in block] if isinstance(block, (list, tuple)) and all(
            isinstance(b, (int, str)) and str(b).isdigit() for b in block
        ) else None  # fmt: skip
        if shape != WEIGHT_BLOCK_SIZE:
            raise _refuse(
                f"{field}.block_structure", args.get("block_structure"),
                f"moekit's block-scaled FP8 weights have {FP8_BLOCK}x{FP8_BLOCK} blocks "
                f"({WEIGHT_BLOCK_SIZE}) only",
            )  # fmt: skip
    return stored


def _act_quant(args: object, field: str) -> ActivationQuant:
    if args is None:
        return ActivationQuant.NONE  # weight-only FP8 (W8A16): activations stay in act_dtype
    if not isinstance(args, Mapping):
        raise _refuse(field, args, "must be an object or null")
    _check_fp8(args, field)
    dynamic = args.get("dynamic", False)
    if dynamic is not True:
        raise _refuse(
            f"{field}.dynamic", dynamic,
            "static activation scales (the checkpoint's `.input_scale` tensors) are not supported: moekit "
            "quantizes activations dynamically, per token or per 1x128 group, at run time; a static scale "
            "would give other numbers. Quantize the model with dynamic activations (llm-compressor's "
            "FP8_DYNAMIC or FP8_BLOCK scheme)",
        )  # fmt: skip
    strategy = _strategy(args, field)
    act = _DYNAMIC_ACTS.get(strategy)
    if act is ActivationQuant.FP8_PER_GROUP_128 and args.get("group_size") != FP8_BLOCK:
        raise _refuse(
            f"{field}.group_size", args.get("group_size"),
            f"moekit's per-group activation scales cover {FP8_BLOCK} columns",
        )  # fmt: skip
    if act is None:
        raise _refuse(
            f"{field}.strategy", strategy,
            f"moekit quantizes activations per token ('token') or per {FP8_BLOCK}-column group ('group', "
            f"group_size {FP8_BLOCK}) only",
        )  # fmt: skip
    return act


def _check_format(quant: Mapping[str, object], scheme: Mapping[str, object], group: str) -> None:
    top = quant.get("format")
    own = scheme.get("format")
    field, fmt = (
        (f"config_groups.{group}.format", own) if own is not None or top == _MIXED else ("format", top)
    )
    if fmt not in _FORMATS:
        raise _refuse(
            field, fmt,
            f"this compressed-tensors format is not supported for the experts; moekit reads {list(_FORMATS)} "
            "(FP8 E4M3 codes with `.weight_scale`), not packed (pack-quantized, nvfp4-pack-quantized, "
            "mxfp4-pack-quantized), integer or dense ones",
        )  # fmt: skip


def compressed_tensors_experts(
    quant: Mapping[str, object], modules: Sequence[str]
) -> ExpertQuantization | None:
    """How the compressed-tensors `quant` stores the expert projections `modules` (one layer's; module
    docstring); None when it leaves every one of them float."""
    _empty(quant, "sparsity_config", "sparse checkpoints are not supported")
    _empty(quant, "transform_config", "rotated (transformed) weights are not supported: moekit would "
           "compute the layer without the rotations")  # fmt: skip
    _empty(quant, "moe_sparsity_config", "checkpoints with pruned experts are not supported")
    groups, ignore = _groups(quant), _strings(quant, "ignore")
    ignored = {m for m in modules if any(_matches(m, i) for i in ignore)}
    touched: dict[str, list[str]] = {}
    for name, scheme in groups.items():
        targets = scheme.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise _refuse(f"config_groups.{name}.targets", targets, "must be a list of strings")
        hit = [m for m in modules if m not in ignored and any(_matches(m, t) for t in targets)]
        if hit:
            touched[name] = hit
    if not touched:
        return None
    if len(touched) > 1:
        shown = {name: hit[0] for name, hit in touched.items()}
        raise _refuse(
            "config_groups", sorted(touched),
            f"more than one group quantizes this layer's experts (e.g. {shown}); moekit reads one format "
            "for all of a layer's experts",
        )  # fmt: skip
    name, hit = touched.popitem()
    if len(hit) != len(modules):
        left = next(m for m in modules if m not in hit)
        why = "lists it" if left in ignored else "does not cover it"
        raise _refuse(
            "ignore" if left in ignored else f"config_groups.{name}.targets",
            ignore if left in ignored else groups[name].get("targets"),
            f"group {name!r} quantizes {hit[0]!r} but leaves {left!r} float (the field {why}); moekit "
            "reads all of a layer's experts in one format",
        )  # fmt: skip
    scheme, field = groups[name], f"config_groups.{name}"
    _check_format(quant, scheme, name)
    if scheme.get("output_activations") is not None:
        raise _refuse(f"{field}.output_activations", scheme["output_activations"], "not supported")
    stored = _weight_scale(scheme.get("weights"), f"{field}.weights")
    act = _act_quant(scheme.get("input_activations"), f"{field}.input_activations")
    if act is ActivationQuant.FP8_PER_GROUP_128 and stored is not StoredScale.BLOCK_128:
        raise _refuse(
            f"{field}.input_activations.strategy", "group",
            f"moekit pairs per-1x128-group activation scales with 128x128 block weight scales only, and "
            f"these weights are per {stored.value}",
        )  # fmt: skip
    # Per-tensor weights map to per-channel scales: a w13 expert holds the gate and the up projection,
    # whose per-tensor scales differ, so one [E] scale could not hold both without requantizing the codes;
    # each projection's scale repeated over its rows keeps every code and every product exact.
    fp8_scale = Fp8Scale.BLOCK_128 if stored is StoredScale.BLOCK_128 else Fp8Scale.PER_CHANNEL
    return ExpertQuantization(CT_SCALE_SUFFIX, stored, fp8_scale, act, CT_METHOD)

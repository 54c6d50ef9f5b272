"""llm-compressor ("compressed-tensors") FP8 checkpoints read by the per-expert Hugging Face loader.

Data flow: `hf_compressed.write_ct_checkpoint` (random FP8 codes and positive scales, written with
safetensors as compressed-tensors 0.20.1 saves them: `.weight` + `.weight_scale` per channel, per tensor
or per 128x128 block, a quantization_config with config_groups and ignore) -> `load_hf_moe_layer` ->
the loaded `ExpertWeights` dequantize bit for bit to codes x scale as the file holds them; the layer's
reference equals a hand computation from the file; a rank's share (EP 2, TP 2) equals `expert_shard` /
`tensor_shard` of the whole layer and reads only its bytes; each unsupported config is refused (type and
message) before any tensor data is read.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_compressed import LAYER, SIZES, E, ct_config, write_ct_checkpoint
from moekit import CheckpointError, FusedMoE
from moekit.checkpoint import HfCheckpointFamily, load_hf_moe_layer
from moekit.formats import dequantize_fp8_weight
from moekit.ops import route
from moekit.parallel import ParallelMode, RankShare, expert_shard, tensor_shard
from moekit.reference import fused_moe_reference, relative_l2_error
from moekit.spec import ActivationQuant, Fp8Scale, WeightFormat
from safetensors_spy import spy_reads

QWEN3, MIXTRAL, DEEPSEEK = (
    HfCheckpointFamily.QWEN3_MOE,
    HfCheckpointFamily.MIXTRAL,
    HfCheckpointFamily.DEEPSEEK_V3,
)
ACTS = {
    None: ActivationQuant.NONE,
    "token": ActivationQuant.FP8_PER_TOKEN,
    "group": ActivationQuant.FP8_PER_GROUP_128,
}
CASES = [  # (family, weight strategy, activation strategy, scale dtype): each layout, strategy, act, dtype
    (QWEN3, "channel", "token", torch.bfloat16),  # RedHatAI's -FP8-dynamic
    (QWEN3, "tensor", None, torch.float32),  # W8A16, naive-quantized
    (MIXTRAL, "channel", None, torch.float16),
    (MIXTRAL, "tensor", "token", torch.bfloat16),  # gate and up scales differ: per-channel in moekit
    (DEEPSEEK, "block", "group", torch.bfloat16),  # llm-compressor's FP8_BLOCK
]
IDS = [f"{f.value}-{s}-{a}" for f, s, a, _ in CASES]


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int]]:
    return spy_reads(monkeypatch)


def _hand_layer(written, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The layer from the file's codes and scales, one token and expert at a time, in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate = x[t] @ written.dequantized(e, "gate").T
            up = x[t] @ written.dequantized(e, "up").T
            out[t] += weights[t, k] * (
                (torch.nn.functional.silu(gate) * up) @ written.dequantized(e, "down").T
            )
    return out


@pytest.mark.parametrize(("family", "strategy", "act", "scale_dtype"), CASES, ids=IDS)
def test_a_compressed_tensors_checkpoint_is_read_as_the_file_holds(
    tmp_path, family, strategy, act, scale_dtype
):
    written = write_ct_checkpoint(tmp_path, family, strategy, act, scale_dtype=scale_dtype)
    loaded = load_hf_moe_layer(tmp_path, layer=LAYER, act_dtype=torch.float32)
    spec, w = loaded.spec, loaded.weights
    h, i = SIZES[strategy]
    granularity = Fp8Scale.BLOCK_128 if strategy == "block" else Fp8Scale.PER_CHANNEL
    assert (spec.E, spec.H, spec.I, spec.weight_format) == (E, h, i, WeightFormat.FP8_E4M3)
    assert (spec.fp8_scale, spec.act_quant, w.fp8_scale) == (granularity, ACTS[act], granularity)
    w13 = dequantize_fp8_weight(w.w13, w.w13_scale, granularity=granularity)
    w2 = dequantize_fp8_weight(w.w2, w.w2_scale, granularity=granularity)
    for e in range(E):  # bit for bit: codes x scale as the file holds them
        assert torch.equal(w13[e, :i], written.dequantized(e, "gate")), e
        assert torch.equal(w13[e, i:], written.dequantized(e, "up")), e
        assert torch.equal(w2[e], written.dequantized(e, "down")), e
        assert torch.equal(w.w13[e].view(torch.uint8)[:i], written.codes[e, "gate"].view(torch.uint8))
    x = torch.randn(13, h, generator=torch.Generator().manual_seed(1))
    routing = route(
        loaded.router_logits(x), top_k=2, spec=spec.routing, correction_bias=loaded.correction_bias
    )
    hand = _hand_layer(written, x, routing.ids, routing.weights)
    unquantized_acts = replace(spec, act_quant=ActivationQuant.NONE)
    got = torch.full_like(x, float("nan"))
    got.copy_(fused_moe_reference(x, w, routing, spec=unquantized_acts))
    torch.testing.assert_close(got, hand, rtol=1e-5, atol=1e-5 * hand.abs().max().item())
    if act is not None:  # FP8 activations as the config says: the cost of their rounding, no more
        quantized = fused_moe_reference(x, w, routing, spec=spec)
        assert 1e-4 < relative_l2_error(quantized, hand) < 6e-2


def _expected_bytes(written, mode: ParallelMode, rank: int, scale_bytes: int) -> int:
    """The file bytes rank `rank` of 2 needs: its experts whole (EP), or half of every expert's I (TP)."""
    h, i = SIZES[written.strategy]
    router = sum(t.nbytes for k, t in written.tensors.items() if ".gate." in k)  # weight [+ bias]
    if mode is ParallelMode.EXPERT:
        experts = range(3) if rank == 0 else range(3, E)
        return router + sum(
            written.tensors[written.key(e, role, suffix)].nbytes
            for e in experts
            for role in ("gate", "up", "down")
            for suffix in ("weight", "weight_scale")
        )
    il = i // 2
    codes = 3 * il * h  # gate and up rows, down columns: one byte a code
    scales = {
        "channel": (2 * il + h) * scale_bytes,  # gate and up rows' scales, down's whole
        "tensor": 3 * scale_bytes,
        "block": (2 * (il // 128) * -(-h // 128) + -(-h // 128) * (il // 128)) * scale_bytes,
    }[written.strategy]
    return router + E * (codes + scales)


@pytest.mark.parametrize(("family", "strategy", "act", "scale_dtype"), CASES[1:], ids=IDS[1:])
@pytest.mark.parametrize("mode", list(ParallelMode), ids=[m.value for m in ParallelMode])
def test_a_rank_reads_exactly_its_share(tmp_path, reads, mode, family, strategy, act, scale_dtype) -> None:
    written = write_ct_checkpoint(tmp_path, family, strategy, act, scale_dtype=scale_dtype, seed=4)
    whole = load_hf_moe_layer(tmp_path, layer=LAYER, act_dtype=torch.float32)
    cut = expert_shard if mode is ParallelMode.EXPERT else tensor_shard
    for rank in range(2):
        reads.clear()
        got = load_hf_moe_layer(
            tmp_path, layer=LAYER, act_dtype=torch.float32, share=RankShare(mode, rank, 2)
        )
        expected = cut(whole.spec, whole.weights, rank=rank, world_size=2)[1]
        for name, t in expected.tensors().items():
            assert torch.equal(getattr(got.weights, name), t), (rank, name)
        assert got.spec == whole.spec
        assert sum(n for _, n in reads) == _expected_bytes(written, mode, rank, scale_dtype.itemsize)


def test_scalar_tensor_scales_and_a_layer_that_runs(tmp_path) -> None:
    """Older llm-compressor files store a per-tensor scale as a 0-d tensor; FusedMoE runs either."""
    written = write_ct_checkpoint(tmp_path, MIXTRAL, "tensor", "token", scalar_tensor_scales=True, seed=2)
    assert written.scales[0, "gate"].shape == ()
    loaded = load_hf_moe_layer(tmp_path, layer=LAYER, act_dtype=torch.float32)
    assert torch.equal(
        loaded.weights.w2_scale[3], written.scales[3, "down"].float().expand(SIZES["tensor"][0])
    )
    layer = FusedMoE.from_hf_checkpoint(tmp_path, LAYER, act_dtype=torch.float32)
    x = torch.randn(7, SIZES["tensor"][0], generator=torch.Generator().manual_seed(3))
    routing = route(loaded.router_logits(x), top_k=2, spec=loaded.spec.routing)
    ref = fused_moe_reference(x, loaded.weights, routing, spec=loaded.spec)
    assert relative_l2_error(layer(x), ref) < 1e-5


def test_moekit_explain_and_run_take_a_compressed_tensors_checkpoint(tmp_path: Path, capsys) -> None:
    from moekit.app.cli import main

    write_ct_checkpoint(tmp_path, QWEN3, "channel", "token")
    assert main(["explain", "--config", str(tmp_path / "config.json"), "--device", "h200", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)["spec"]
    assert spec.startswith(
        f"E={E} K=2 H=64 I=96 FP8_E4M3/PER_CHANNEL act=bfloat16 act_quant=FP8_PER_TOKEN"
    ), spec
    assert main(["run", "--checkpoint", str(tmp_path), "--layer", str(LAYER), "--tokens", "5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["check_passed"] and "PER_CHANNEL" in report["spec"]


def test_experts_the_config_ignores_are_read_as_float(tmp_path) -> None:
    config = ct_config(QWEN3, "channel", "token")
    config["quantization_config"]["ignore"] += [r"re:.*mlp\.experts\."]
    g = torch.Generator().manual_seed(5)
    prefix = QWEN3.layout.prefix(LAYER)
    tensors = {f"{prefix}.gate.weight": torch.randn(E, 64, generator=g)}
    for e in range(E):
        for proj, shape in (("gate_proj", (96, 64)), ("up_proj", (96, 64)), ("down_proj", (64, 96))):
            tensors[f"{prefix}.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=g).bfloat16()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_hf_moe_layer(tmp_path, layer=LAYER)
    assert loaded.spec.weight_format is WeightFormat.BF16 and loaded.spec.act_quant is ActivationQuant.NONE
    assert torch.equal(loaded.weights.w2[2], tensors[f"{prefix}.experts.2.down_proj.weight"])
    write_ct_checkpoint(tmp_path, QWEN3, "channel", "token")  # FP8 experts the config calls float
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"is F8_E4M3, but config.json has no quantization_config that q"
    ):
        load_hf_moe_layer(tmp_path, layer=LAYER)


def _group(config: dict) -> dict:
    return config["quantization_config"]["config_groups"]["group_0"]


def _mutations() -> list[tuple[str, object, str]]:
    """(id, change to a Qwen3 channel/token config, the refusal's message)."""

    def at(path: str, value: object):
        def change(config: dict) -> None:
            *parents, last = path.split(".")
            node = _group(config)
            for p in parents:
                node = node[p]
            node[last] = value

        return change

    def top(name: str, value: object):
        return lambda config: config["quantization_config"].__setitem__(name, value)

    def second_group(config: dict) -> None:
        config["quantization_config"]["config_groups"]["group_1"] = {
            **copy.deepcopy(_group(config)), "targets": [r"re:.*down_proj$"]
        }  # fmt: skip

    def block(config: dict) -> None:
        _group(config)["weights"] |= {"strategy": "block", "block_structure": [64, 64]}

    g0 = "quantization_config.config_groups.group_0"
    return [
        ("bits", at("weights.num_bits", 4), rf"{g0}.weights.num_bits=4: moekit reads 8-bit FP8"),
        ("int", at("weights.type", "int"), rf"{g0}.weights.type='int': moekit reads 'float'"),
        ("asym", at("weights.symmetric", False), rf"{g0}.weights.symmetric=False: moekit's FP8 has no zero"),
        ("group", at("weights.strategy", "group"), rf"{g0}.weights.strategy='group': moekit's FP8 weights"),
        ("block64", block, rf"{g0}.weights.block_structure=\[64, 64\]: .* 128x128 blocks"),
        (
            "two groups",
            second_group,
            r"config_groups=\['group_0', 'group_1'\]: more than one group quantizes",
        ),
        (
            "ignored expert",
            lambda c: c["quantization_config"]["ignore"].append(r"re:.*experts\.0\."),
            r"config.ignore=.*leaves 'model.layers.\d.mlp.experts.0.gate_proj' float \(the field lists",
        ),
        (
            "untargeted down",
            at("targets", [r"re:.*(gate|up)_proj$"]),
            rf"{g0}.targets=.*leaves '.*experts.0.down_proj' float \(the field does not cover",
        ),
        (
            "packed",
            top("format", "pack-quantized"),
            r"format='pack-quantized': this compressed-tensors format",
        ),
        (
            "nvfp4",
            top("format", "nvfp4-pack-quantized"),
            r"format='nvfp4-pack-quantized': this compressed-ten",
        ),
        (
            "mixed",
            top("format", "mixed-precision"),
            rf"{g0}.format=None: this compressed-tensors format is not",
        ),
        (
            "static",
            at("input_activations.dynamic", False),
            r"dynamic=False: static activation scales .*input_sca",
        ),
        (
            "act tensor",
            at("input_activations.strategy", "tensor"),
            r"strategy='tensor': moekit quantizes activ",
        ),
        (
            "channel+group",
            lambda c: _group(c)["input_activations"].update(strategy="group", group_size=128),
            r"strategy='group': moekit pairs per-1x128",
        ),
        ("outputs", at("output_activations", {"num_bits": 8}), rf"{g0}.output_activations=.*not supported"),
        (
            "rotated",
            top("transform_config", {"config_groups": {}}),
            r"transform_config=.*rotated .* not supp",
        ),
        ("no groups", top("config_groups", {}), r"config_groups=\{\}: must be an object of one or more"),
    ]


MUTATIONS = _mutations()


@pytest.mark.parametrize(("change", "message"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_an_unsupported_config_is_refused_naming_the_field_before_reading(tmp_path, reads, change, message):
    write_ct_checkpoint(tmp_path, QWEN3, "channel", "token")
    config = ct_config(QWEN3, "channel", "token")
    change(config)
    reads.clear()
    with pytest.raises(CheckpointError, match=message):
        load_hf_moe_layer(tmp_path, layer=LAYER, config=config)
    assert reads == []
    (tmp_path / "config.json").write_text(json.dumps(config))  # `moekit explain --config` says the same
    from moekit.checkpoint.hf_config import spec_from_config_file

    with pytest.raises(CheckpointError, match=message):
        spec_from_config_file(tmp_path / "config.json")


def test_a_group_activation_size_other_than_128_is_refused(tmp_path) -> None:
    config = ct_config(DEEPSEEK, "block", "group")
    _group(config)["input_activations"]["group_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    from moekit.checkpoint.hf_config import spec_from_config_file

    with pytest.raises(CheckpointError, match=r"input_activations.group_size=64: .* cover 128 columns"):
        spec_from_config_file(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1e-3, float("inf")])
def test_a_damaged_scale_is_refused_naming_its_key(tmp_path, bad) -> None:
    written = write_ct_checkpoint(tmp_path, MIXTRAL, "tensor", None, scale_dtype=torch.float32)
    key = written.key(3, "up", "weight_scale")
    written.tensors[key] = torch.tensor([bad])
    save_file(written.tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"not finite and > 0, first in '{key}'"):
        load_hf_moe_layer(tmp_path, layer=LAYER)
    load_hf_moe_layer(tmp_path, layer=LAYER, share=RankShare(ParallelMode.EXPERT, 0, 2))  # experts 0-2


def test_a_quantized_router_and_a_misshapen_scale_are_refused(tmp_path, reads) -> None:
    written = write_ct_checkpoint(tmp_path, QWEN3, "channel", "token")
    router = written.tensors[written.router_key]
    written.tensors[written.router_key] = router.float().to(torch.float8_e4m3fn)
    save_file(written.tensors, str(tmp_path / "model.safetensors"))
    reads.clear()
    with pytest.raises(
        CheckpointError, match=r"the router 'model.layers.1.mlp.gate.weight' is stored F8_E4M3"
    ):
        load_hf_moe_layer(tmp_path, layer=LAYER)
    written.tensors[written.router_key] = router
    key = written.key(0, "down", "weight_scale")
    written.tensors[key] = written.tensors[key][:, 0]  # [out] instead of [out, 1]
    save_file(written.tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"'{key}' has shape \[64\], expected \[64, 1\]"):
        load_hf_moe_layer(tmp_path, layer=LAYER)
    assert reads == []


ACCEPTED = [  # (weights, activations) strategies -> (Fp8Scale, ActivationQuant): every pair MoESpec takes
    ("channel", "token", Fp8Scale.PER_CHANNEL, ActivationQuant.FP8_PER_TOKEN),
    ("channel", None, Fp8Scale.PER_CHANNEL, ActivationQuant.NONE),
    ("tensor", "token", Fp8Scale.PER_CHANNEL, ActivationQuant.FP8_PER_TOKEN),
    ("tensor", None, Fp8Scale.PER_CHANNEL, ActivationQuant.NONE),
    ("block", "group", Fp8Scale.BLOCK_128, ActivationQuant.FP8_PER_GROUP_128),
    ("block", "token", Fp8Scale.BLOCK_128, ActivationQuant.FP8_PER_TOKEN),
    ("block", None, Fp8Scale.BLOCK_128, ActivationQuant.NONE),
]


@pytest.mark.parametrize(
    ("strategy", "act", "scale", "act_quant"), ACCEPTED, ids=[f"{a[0]}-{a[1]}" for a in ACCEPTED]
)
def test_each_supported_scheme_maps_onto_one_moekit_format(tmp_path, strategy, act, scale, act_quant) -> None:
    from moekit.checkpoint.hf_config import spec_from_config_file

    file = tmp_path / "config.json"
    file.write_text(json.dumps(ct_config(DEEPSEEK, strategy, act)))
    spec = spec_from_config_file(file)
    assert (spec.weight_format, spec.fp8_scale, spec.act_quant) == (WeightFormat.FP8_E4M3, scale, act_quant)


def test_the_spellings_compressed_tensors_accepts_are_read(tmp_path) -> None:
    """A null strategy is group_size's (-1: channel); "RxC" block strings; a mixed-precision config's group
    format; upper-case enum values (QuantizationArgs lowercases them)."""
    from moekit.checkpoint.hf_config import spec_from_config_file

    file = tmp_path / "config.json"
    config = ct_config(QWEN3, "channel", "token")
    _group(config)["weights"] |= {"strategy": None, "group_size": -1, "type": "FLOAT"}
    config["quantization_config"]["format"] = "mixed-precision"
    _group(config)["format"] = "float-quantized"
    file.write_text(json.dumps(config))
    assert spec_from_config_file(file).fp8_scale is Fp8Scale.PER_CHANNEL
    _group(config)["weights"] |= {"strategy": None, "group_size": None}  # none: per tensor
    file.write_text(json.dumps(config))
    assert spec_from_config_file(file).fp8_scale is Fp8Scale.PER_CHANNEL  # per-tensor, read per channel
    config = ct_config(DEEPSEEK, "block", "group")
    _group(config)["weights"] |= {"strategy": "BLOCK", "block_structure": "128x128"}
    file.write_text(json.dumps(config))
    assert spec_from_config_file(file).fp8_scale is Fp8Scale.BLOCK_128
    _group(config)["weights"]["block_structure"] = "128x64"
    file.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"block_structure='128x64': moekit's block-scaled FP8"):
        spec_from_config_file(file)

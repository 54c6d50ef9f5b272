"""Per-expert Hugging Face checkpoints that `load_hf_moe_layer` and `moekit explain --config` must refuse,
each with a CheckpointError/SpecError naming the key or config field, before any tensor data is read.

Data flow: a tiny per-expert checkpoint written here with safetensors (Qwen3-MoE or DeepSeek-V3 names, the
config.json transformers would write) or an FP8 one (tests/hf_checkpoints.py) -> one config field or
tensor changed -> the loader's refusal, with the spy (tests/safetensors_spy.py) showing no data read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hf_checkpoints import fp8_config, write_fp8_checkpoint
from moekit import CheckpointError, SpecError
from moekit.checkpoint import HfCheckpointFamily, load_hf_moe_layer
from moekit.checkpoint.hf_config import spec_from_config_file
from safetensors_spy import spy_reads

E, H, I = 4, 32, 48
QWEN3 = HfCheckpointFamily.QWEN3_MOE
DEEPSEEK = HfCheckpointFamily.DEEPSEEK_V3


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int]]:
    return spy_reads(monkeypatch)


def _config(family: HfCheckpointFamily, layers: int) -> dict:
    config = {
        "model_type": family.value, "hidden_size": H, "moe_intermediate_size": I, "num_experts_per_tok": 2,
        "hidden_act": "silu", "num_hidden_layers": layers, "dtype": "float32",
    }  # fmt: skip
    if family is DEEPSEEK:
        grouped = {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "first_k_dense_replace": 0}
        return {**config, **grouped, "n_routed_experts": E, "norm_topk_prob": True}
    return {
        **config,
        "num_experts": E,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
    }


def _write(folder: Path, family: HfCheckpointFamily, *, layers: int = 2, dtype=torch.float32) -> dict:
    """Every layer a MoE layer with random experts; returns the config.json written."""
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp"
        tensors[f"{prefix}.gate.weight"] = torch.randn(E, H, generator=g)
        if family is DEEPSEEK:
            tensors[f"{prefix}.gate.e_score_correction_bias"] = torch.rand(E, generator=g)
        for e in range(E):
            for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
                tensors[f"{prefix}.experts.{e}.{name}.weight"] = torch.randn(shape, generator=g).to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    config = _config(family, layers)
    (folder / "config.json").write_text(json.dumps(config))
    return config


def test_a_layer_config_json_makes_dense_is_refused_even_with_experts_on_disk(tmp_path, reads) -> None:
    config = _write(tmp_path, QWEN3, layers=3)
    for change, layer, why in (
        ({"mlp_only_layers": [1]}, 1, r"mlp_only_layers=\[1\] lists it"),
        ({"decoder_sparse_step": 2}, 0, r"decoder_sparse_step=2: only layers l with \(l \+ 1\) % 2 == 0"),
    ):
        with pytest.raises(
            CheckpointError, match=rf"layer {layer} is a dense MLP layer by config.json \({why}"
        ):
            load_hf_moe_layer(tmp_path, layer=layer, config={**config, **change})
    assert load_hf_moe_layer(tmp_path, layer=1, config={**config, "decoder_sparse_step": 2}).spec.E == E
    reads.clear()
    with pytest.raises(CheckpointError, match=r"decoder_sparse_step=0 must be >= 1"):
        load_hf_moe_layer(tmp_path, layer=1, config={**config, "decoder_sparse_step": 0})
    ds = tmp_path / "deepseek"
    ds.mkdir()
    config = _write(ds, DEEPSEEK)
    with pytest.raises(CheckpointError, match=r"layer 1 is a dense .*first_k_dense_replace=2: layers 0..1"):
        load_hf_moe_layer(ds, layer=1, config={**config, "first_k_dense_replace": 2})
    assert reads == []


def test_config_fields_of_an_odd_type_are_refused_by_name(tmp_path, capsys) -> None:
    from moekit.app.cli import main

    config = _write(tmp_path, DEEPSEEK)
    with pytest.raises(SpecError, match=r"hidden_act=\['silu'\] has no moekit activation"):
        load_hf_moe_layer(tmp_path, layer=1, config={**config, "hidden_act": ["silu"]})
    quant = {"quant_method": "fp8", "weight_block_size": 128}
    with pytest.raises(CheckpointError, match=r"'weight_block_size': 128\} is not one moekit reads"):
        load_hf_moe_layer(tmp_path, layer=1, config={**config, "quantization_config": quant})
    quant = {**fp8_config(DEEPSEEK)["quantization_config"], "expert_dtype": "fp4"}  # DeepSeek-V4's packing
    with pytest.raises(CheckpointError, match=r"'expert_dtype': 'fp4'\} is not one moekit reads"):
        load_hf_moe_layer(tmp_path, layer=1, config={**config, "quantization_config": quant})
    for topk_group in (0, 2):  # one group: transformers fails (2) or masks every expert (0)
        with pytest.raises(SpecError, match=rf"topk_group={topk_group} with n_group=1"):
            load_hf_moe_layer(tmp_path, layer=1, config={**config, "topk_group": topk_group})
    (tmp_path / "qwen").mkdir()
    qwen = {k: v for k, v in _write(tmp_path / "qwen", QWEN3).items() if k != "norm_topk_prob"}
    with pytest.raises(
        CheckpointError, match="'norm_topk_prob' must be true or false, but config.json has no"
    ):
        load_hf_moe_layer(tmp_path / "qwen", layer=1, config=qwen)
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**config, "dtype": ["float32"]}))
    assert main(["explain", "--config", str(file)]) == 2
    assert "names the weights' dtype ['float32']" in capsys.readouterr().err
    file.write_text(json.dumps({**config, "hidden_act": {"name": "silu"}}))
    assert main(["explain", "--config", str(tmp_path)]) == 2  # a folder: its config.json
    assert "hidden_act={'name': 'silu'} has no moekit activation" in capsys.readouterr().err


def test_explain_refuses_an_fp8_config_the_loader_refuses(tmp_path) -> None:
    file = tmp_path / "config.json"
    file.write_text(json.dumps({**fp8_config(QWEN3), "moe_intermediate_size": 96}))
    with pytest.raises(CheckpointError, match="moe_intermediate_size=96 is not a multiple of 128"):
        spec_from_config_file(file)
    file.write_text(json.dumps(fp8_config(QWEN3)))
    assert spec_from_config_file(tmp_path).I == 256  # the folder's config.json


def test_experts_stored_otherwise_than_quantization_config_says_are_refused(tmp_path, reads) -> None:
    config = _write(tmp_path, QWEN3)
    quant = fp8_config(QWEN3)["quantization_config"]
    with pytest.raises(
        CheckpointError, match=r"declares FP8 .*'model.layers.0.mlp.experts.0.gate_proj.weight' is F32"
    ):
        load_hf_moe_layer(tmp_path, layer=0, config={**config, "quantization_config": quant})
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    write_fp8_checkpoint(fp8, DEEPSEEK)
    plain = {k: v for k, v in fp8_config(DEEPSEEK).items() if k != "quantization_config"}
    with pytest.raises(
        CheckpointError, match=r"experts.0.gate_proj.weight' is F8_E4M3, but config.json has no qua"
    ):
        load_hf_moe_layer(fp8, layer=3, config=plain)  # not "tensors the loader would not read" (the scales)
    assert reads == []


def test_paths_devices_and_fused_experts(tmp_path, reads) -> None:
    with pytest.raises(CheckpointError, match=r"checkpoint path .*nowhere does not exist"):
        load_hf_moe_layer(tmp_path / "nowhere", layer=0)  # not "is a file: pass config="
    config = _write(tmp_path, QWEN3, layers=1)
    with pytest.raises(
        CheckpointError, match=r"holds no tensor of experts \[4, 5\] \(2 of the E=6 config.json"
    ):
        load_hf_moe_layer(tmp_path, layer=0, config={**config, "num_experts": 6})
    with pytest.raises(
        CheckpointError, match=r"experts \[4, 5, 6, 7, 8, 9, 10, 11\]\.\.\. \(999999999996 of"
    ):
        load_hf_moe_layer(tmp_path, layer=0, config={**config, "num_experts": 10**12})  # no 3e12 key list
    whole = load_hf_moe_layer(tmp_path, layer=0, device="cpu:0", act_dtype=torch.float32)  # torch's cpu:0
    assert torch.equal(
        whole.weights.w2, load_hf_moe_layer(tmp_path, layer=0, act_dtype=torch.float32).weights.w2
    )
    fused = tmp_path / "fused"
    fused.mkdir()
    prefix = "model.layers.0.mlp"
    tensors = {
        f"{prefix}.gate.weight": torch.randn(E, H),
        f"{prefix}.experts.gate_up_proj": torch.randn(E, 2 * I, H),
    }
    save_file(
        {**tensors, f"{prefix}.experts.down_proj": torch.randn(E, H, I)}, str(fused / "model.safetensors")
    )
    (fused / "config.json").write_text(json.dumps(config))
    reads.clear()
    with pytest.raises(CheckpointError, match=r"stores its experts as fused tensors .*experts.down_proj"):
        load_hf_moe_layer(fused, layer=0)
    assert reads == []


def test_moekit_run_takes_a_per_expert_models_safetensors_file_with_its_folders_config(
    tmp_path, capsys
) -> None:
    from moekit.app.cli import main

    _write(tmp_path, QWEN3, layers=1)
    file = str(tmp_path / "model.safetensors")
    assert main(["run", "--checkpoint", file, "--layer", "0", "--tokens", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "(qwen3_moe, routed experts only)" in report["source"] and report["check_passed"]
    assert main(["run", "--checkpoint", file, "--layer", "1"]) == 1  # not the GPT-OSS loader's key list
    assert "layer 1 has no routed experts ('model.layers.1.mlp.experts.*')" in capsys.readouterr().err

"""GPT-OSS MXFP4 checkpoint loading: round trips in both namings, file layouts, laziness, bad inputs.

The expected key names below are written out literally (not taken from moekit.checkpoint), so a
typo in the module's templates fails here. Layer sizes: E=4, H=80, I=48, so both w13 (H=80=2.5x32)
and w2 (I=48=1.5x32) have a ragged last MXFP4 block.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moekit.checkpoint.files as ckpt_files
from moekit import ExpertWeights, FusedMoE, GateLayout, WeightFormat
from moekit.checkpoint import (
    ROLES,
    CheckpointNaming,
    GptOssLayer,
    gpt_oss_layer_keys,
    gpt_oss_layer_tensors,
    load_gpt_oss_layer,
    save_gpt_oss_layer,
)
from moekit.errors import ArgumentError, CheckpointError, DeviceError, DTypeError, LayoutMismatchError

E, H, I = 4, 80, 48

EXPECTED_KEYS = {
    CheckpointNaming.OPENAI: {
        "w13": "block.3.mlp.mlp1_weight.blocks",
        "w13_scale": "block.3.mlp.mlp1_weight.scales",
        "b13": "block.3.mlp.mlp1_bias",
        "w2": "block.3.mlp.mlp2_weight.blocks",
        "w2_scale": "block.3.mlp.mlp2_weight.scales",
        "b2": "block.3.mlp.mlp2_bias",
        "router_weight": "block.3.mlp.gate.weight",
        "router_bias": "block.3.mlp.gate.bias",
    },
    CheckpointNaming.HF: {
        "w13": "model.layers.3.mlp.experts.gate_up_proj_blocks",
        "w13_scale": "model.layers.3.mlp.experts.gate_up_proj_scales",
        "b13": "model.layers.3.mlp.experts.gate_up_proj_bias",
        "w2": "model.layers.3.mlp.experts.down_proj_blocks",
        "w2_scale": "model.layers.3.mlp.experts.down_proj_scales",
        "b2": "model.layers.3.mlp.experts.down_proj_bias",
        "router_weight": "model.layers.3.mlp.router.weight",
        "router_bias": "model.layers.3.mlp.router.bias",
    },
}
NAMINGS = list(CheckpointNaming)


def make_layer(*, seed: int, layer: int = 3, naming: CheckpointNaming = CheckpointNaming.HF) -> GptOssLayer:
    """Random layer with distinct gate and up rows (interleaved) and scales spread over many exponents."""
    g = torch.Generator().manual_seed(seed)
    row_scale = lambda n: 2.0 ** torch.randint(-6, 7, (E, n, 1), generator=g)  # noqa: E731
    gate = torch.randn(E, I, H, generator=g) * row_scale(I)
    up = (torch.rand(E, I, H, generator=g) - 0.3) * row_scale(I)  # a different distribution than gate
    w13 = torch.stack([gate, up], dim=2).reshape(E, 2 * I, H)  # row 2j gate j, row 2j+1 up j
    w2 = torch.randn(E, H, I, generator=g) * row_scale(H)
    weights = ExpertWeights.from_float(
        w13=w13,
        w2=w2,
        b13=torch.randn(E, 2 * I, generator=g).bfloat16(),
        b2=torch.randn(E, H, generator=g).bfloat16(),
        format=WeightFormat.MXFP4,
        gate_layout=GateLayout.INTERLEAVED,
    )
    return GptOssLayer(
        weights=weights,
        router_weight=torch.randn(E, H, generator=g).bfloat16(),
        router_bias=torch.randn(E, generator=g).bfloat16(),
        naming=naming,
        layer=layer,
    )


def assert_same_layer(a: GptOssLayer, b: GptOssLayer) -> None:
    ta, tb = a.tensors(), b.tensors()
    assert set(ta) == set(tb) == set(ROLES)
    for role in ROLES:
        assert ta[role].dtype == tb[role].dtype, role
        assert torch.equal(ta[role], tb[role]), role  # bit for bit
    for e in range(E):
        assert torch.equal(a.weights.dequantize_w13(e), b.weights.dequantize_w13(e))
        assert torch.equal(a.weights.dequantize_w2(e), b.weights.dequantize_w2(e))


def file_keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


# ----- round trips --------------------------------------------------------------------------------------
@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("given_naming", [True, False], ids=["naming_given", "auto_detect"])
def test_round_trip_single_file(tmp_path: Path, naming: CheckpointNaming, given_naming: bool) -> None:
    src = make_layer(seed=1)
    path = save_gpt_oss_layer(tmp_path / "layer.safetensors", src, layer=3, naming=naming)
    assert file_keys(path) == set(EXPECTED_KEYS[naming].values())
    assert gpt_oss_layer_keys(naming=naming, layer=3) == EXPECTED_KEYS[naming]
    got = load_gpt_oss_layer(path, layer=3, naming=naming if given_naming else None)
    assert got.naming is naming and got.layer == 3
    assert got.weights.format is WeightFormat.MXFP4 and got.weights.gate_layout is GateLayout.INTERLEAVED
    assert_same_layer(src, got)
    spec = got.spec_for(act_dtype=torch.float32)
    assert (spec.E, spec.H, spec.I, spec.K) == (E, H, I, 4)
    assert spec.activation.alpha == 1.702 and spec.activation.limit == 7.0
    got.weights.validate(spec, check_nan_scales=True)


def test_router_logits_match_linear() -> None:
    layer = make_layer(seed=2)
    x = torch.randn(5, H)
    expected = x @ layer.router_weight.float().T + layer.router_bias.float()
    torch.testing.assert_close(layer.router_logits(x), expected)


@pytest.mark.parametrize("naming", NAMINGS)
def test_directory_of_shards(tmp_path: Path, naming: CheckpointNaming) -> None:
    layers = {n: make_layer(seed=10 + n, layer=n, naming=naming) for n in range(3)}
    for n, lay in layers.items():
        write(tmp_path / f"shard-{n}.safetensors", gpt_oss_layer_tensors(lay, layer=n, naming=naming))
    other = {
        CheckpointNaming.OPENAI: "block.0.attn.norm.scale",
        CheckpointNaming.HF: "model.layers.0.self_attn.sinks",
    }
    write(tmp_path / "other.safetensors", {other[naming]: torch.ones(H)})  # non-MoE tensors are ignored
    for n in (0, 2):
        assert_same_layer(layers[n], load_gpt_oss_layer(tmp_path, layer=n))


@pytest.mark.parametrize("naming", NAMINGS)
def test_index_json_with_layer_split_across_shards(tmp_path: Path, naming: CheckpointNaming) -> None:
    src = make_layer(seed=3)
    tensors = gpt_oss_layer_tensors(src, layer=3, naming=naming)
    keys = EXPECTED_KEYS[naming]
    router = {k: tensors[k] for k in (keys["router_weight"], keys["router_bias"])}
    experts = {k: v for k, v in tensors.items() if k not in router}
    write(tmp_path / "model-00001-of-00002.safetensors", experts)
    write(tmp_path / "model-00002-of-00002.safetensors", router)
    weight_map = {k: "model-00001-of-00002.safetensors" for k in experts}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in router}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    # A stray file outside the index must be ignored: its conflicting copy of the layer is never read.
    write(tmp_path / "stray.safetensors", gpt_oss_layer_tensors(make_layer(seed=4), layer=3, naming=naming))
    assert_same_layer(src, load_gpt_oss_layer(tmp_path, layer=3))


# ----- laziness -------------------------------------------------------------------------------------------
class _SpyFile:
    """Wraps a safetensors handle and records which tensors' data are read."""

    def __init__(self, real: object, log: list[str]) -> None:
        self._real, self._log = real, log

    def __enter__(self) -> _SpyFile:
        self._f = self._real.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._real.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._f.keys()

    def get_slice(self, key: str) -> object:
        return self._f.get_slice(key)  # header metadata only; the test never sees data read through it

    def get_tensor(self, key: str) -> torch.Tensor:
        self._log.append(key)
        return self._f.get_tensor(key)


@pytest.mark.parametrize("naming", NAMINGS)
def test_reads_only_the_requested_layer(tmp_path: Path, naming: CheckpointNaming, monkeypatch) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for n in range(4):
        tensors |= gpt_oss_layer_tensors(make_layer(seed=20 + n, layer=n), layer=n, naming=naming)
    path = write(tmp_path / "model.safetensors", tensors)
    log: list[str] = []
    real_open = ckpt_files.safe_open
    monkeypatch.setattr(ckpt_files, "safe_open", lambda *a, **kw: _SpyFile(real_open(*a, **kw), log))
    got = load_gpt_oss_layer(path, layer=2, naming=naming)
    assert sorted(log) == sorted(gpt_oss_layer_keys(naming=naming, layer=2).values())
    assert torch.equal(got.weights.w13, tensors[gpt_oss_layer_keys(naming=naming, layer=2)["w13"]])


# ----- bad inputs -----------------------------------------------------------------------------------------
@pytest.fixture
def hf_tensors() -> dict[str, torch.Tensor]:
    return gpt_oss_layer_tensors(make_layer(seed=5), layer=3, naming=CheckpointNaming.HF)


KEYS = EXPECTED_KEYS[CheckpointNaming.HF]


@pytest.mark.parametrize("role", ROLES)
def test_missing_tensor_names_key_and_file(tmp_path: Path, hf_tensors, role: str) -> None:
    del hf_tensors[KEYS[role]]
    path = write(tmp_path / "m.safetensors", hf_tensors)
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load_gpt_oss_layer(path, layer=3)
    assert KEYS[role] in str(err.value) and str(path) in str(err.value)


def test_missing_tensor_in_index_names_the_index(tmp_path: Path, hf_tensors) -> None:
    del hf_tensors[KEYS["b2"]]
    write(tmp_path / "a.safetensors", hf_tensors)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {k: "a.safetensors" for k in hf_tensors}}))
    with pytest.raises(CheckpointError, match="down_proj_bias") as err:
        load_gpt_oss_layer(tmp_path, layer=3)
    assert str(index) in str(err.value)


def test_index_pointing_to_missing_shard(tmp_path: Path, hf_tensors) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "gone.safetensors" for k in hf_tensors}})
    )
    with pytest.raises(CheckpointError, match="gone.safetensors"):
        load_gpt_oss_layer(tmp_path, layer=3)
    # An index that names an existing shard which lacks the key.
    del hf_tensors[KEYS["b13"]]
    write(tmp_path / "a.safetensors", hf_tensors)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "a.safetensors" for k in KEYS.values()}})
    )
    with pytest.raises(CheckpointError, match="gate_up_proj_bias'.*the index names"):
        load_gpt_oss_layer(tmp_path, layer=3)


# (role, wrong shape, expected shape in the message): each dim of each kind of tensor at least once.
BAD_SHAPES = [
    ("w13", (E, 2 * I, 2, 16), [E, 2 * I, 3, 16]),  # G_H = ceil(80/32) = 3, not floor
    ("w13_scale", (E, 2 * I - 2, 3), [E, 2 * I, 3]),
    ("b13", (E, 2 * I + 1), [E, 2 * I]),
    ("w2", (E, H, 2, 8), [E, H, 2, 16]),
    ("w2_scale", (E + 1, H, 2), [E, H, 2]),
    ("b2", (E, H + 1), [E, H]),
    ("router_weight", (E, H - 1), [E, H]),
    ("router_bias", (E, 1), [E]),
]


@pytest.mark.parametrize(("role", "shape", "expected"), BAD_SHAPES, ids=[b[0] for b in BAD_SHAPES])
def test_wrong_shape_names_tensor_and_expected_shape(tmp_path: Path, hf_tensors, role, shape, expected):
    dtype = hf_tensors[KEYS[role]].dtype
    hf_tensors[KEYS[role]] = torch.zeros(shape, dtype=dtype)
    path = write(tmp_path / "m.safetensors", hf_tensors)
    with pytest.raises(CheckpointError, match="has shape") as err:
        load_gpt_oss_layer(path, layer=3)
    msg = str(err.value)
    assert KEYS[role] in msg and str(expected) in msg and str(list(shape)) in msg


@pytest.mark.parametrize(
    ("role", "dtype", "expected"),
    [
        ("w13", torch.int8, "U8"),
        ("w2_scale", torch.float32, "U8"),
        ("b13", torch.int32, "float"),
        ("router_weight", torch.float64, "float"),
        ("w2", torch.bfloat16, "U8"),
    ],
)
def test_wrong_dtype_names_tensor(tmp_path: Path, hf_tensors, role: str, dtype: torch.dtype, expected: str):
    hf_tensors[KEYS[role]] = hf_tensors[KEYS[role]].to(dtype)
    path = write(tmp_path / "m.safetensors", hf_tensors)
    with pytest.raises(CheckpointError, match="has dtype") as err:
        load_gpt_oss_layer(path, layer=3)
    assert KEYS[role] in str(err.value) and expected in str(err.value)


def test_nan_scale_byte_is_refused(tmp_path: Path, hf_tensors) -> None:
    hf_tensors[KEYS["w2_scale"]][1, 7, 1] = 0xFF
    path = write(tmp_path / "m.safetensors", hf_tensors)
    with pytest.raises(CheckpointError, match="0xFF") as err:
        load_gpt_oss_layer(path, layer=3)
    assert KEYS["w2_scale"] in str(err.value) and "(1, 7, 1)" in str(err.value)


def test_bad_layer_index_lists_layers_found(tmp_path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for n in (0, 1, 5):
        tensors |= gpt_oss_layer_tensors(make_layer(seed=n, layer=n), layer=n, naming=CheckpointNaming.OPENAI)
    path = write(tmp_path / "m.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"layer 7 not found.*0, 1, 5"):
        load_gpt_oss_layer(path, layer=7)
    with pytest.raises(CheckpointError, match="layer must be an int >= 0"):
        load_gpt_oss_layer(path, layer=-1)
    with pytest.raises(CheckpointError, match="HF-named MoE layers found: none"):
        load_gpt_oss_layer(path, layer=0, naming=CheckpointNaming.HF)


def test_naming_detection_failures(tmp_path: Path, hf_tensors) -> None:
    openai = gpt_oss_layer_tensors(make_layer(seed=6), layer=0, naming=CheckpointNaming.OPENAI)
    both = write(tmp_path / "both.safetensors", hf_tensors | openai)
    with pytest.raises(CheckpointError, match="pass naming="):
        load_gpt_oss_layer(both, layer=3)
    assert load_gpt_oss_layer(both, layer=0, naming=CheckpointNaming.OPENAI).naming is CheckpointNaming.OPENAI
    neither = write(tmp_path / "neither.safetensors", {"lm_head.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match="no GPT-OSS MoE tensors.*lm_head.weight"):
        load_gpt_oss_layer(neither, layer=0)


def test_dequantized_hf_checkpoint_gets_a_hint(tmp_path: Path) -> None:
    path = write(
        tmp_path / "m.safetensors",
        {
            "model.layers.0.mlp.experts.gate_up_proj": torch.zeros(E, H, 2 * I),
            "model.layers.0.mlp.experts.down_proj": torch.zeros(E, I, H),
        },
    )
    with pytest.raises(CheckpointError, match="dequantized float experts"):
        load_gpt_oss_layer(path, layer=0)


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gpt_oss_layer(tmp_path / "nope", layer=0)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        load_gpt_oss_layer(tmp_path, layer=0)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_gpt_oss_layer(junk, layer=0)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointError, match="weight_map"):
        load_gpt_oss_layer(tmp_path, layer=0)


def test_a_layer_of_zero_experts_is_named_as_such(tmp_path: Path, hf_tensors) -> None:
    path = write(tmp_path / "m.safetensors", {k: v[:0] for k, v in hf_tensors.items()})
    with pytest.raises(CheckpointError, match="have E=0 experts.*needs at least one expert"):
        load_gpt_oss_layer(path, layer=3)


def test_arguments_of_the_wrong_type_are_refused_at_the_entry(tmp_path: Path) -> None:
    layer, out = make_layer(seed=8), tmp_path / "m.safetensors"
    with pytest.raises(ArgumentError, match=r"path must be a str or PathLike, got 5 \(int\)"):
        load_gpt_oss_layer(5, layer=0)
    with pytest.raises(ArgumentError, match="allow_extra_tensors must be True or False"):
        load_gpt_oss_layer(tmp_path, layer=0, allow_extra_tensors="no")
    with pytest.raises(ArgumentError, match="path must be a str or PathLike"):
        save_gpt_oss_layer(None, layer, layer=0, naming=CheckpointNaming.HF)
    with pytest.raises(DTypeError, match=r"layer_obj_or_tensors\['w13'\] must be a torch.Tensor, got a int"):
        save_gpt_oss_layer(out, dict.fromkeys(ROLES, 0), layer=0, naming=CheckpointNaming.HF)
    assert not out.exists()
    for router_weight in (layer.router_weight.tolist(), layer.router_weight.long()):
        with pytest.raises(
            DTypeError, match="GptOssLayer.router_weight must be a float32, bfloat16 or float16"
        ):
            dataclasses.replace(layer, router_weight=router_weight)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_loading_onto_a_missing_device_is_refused_before_reading(tmp_path: Path) -> None:
    path = save_gpt_oss_layer(
        tmp_path / "m.safetensors", make_layer(seed=9), layer=3, naming=CheckpointNaming.HF
    )
    for load in (
        lambda device: load_gpt_oss_layer(path, layer=3, device=device),
        lambda device: FusedMoE.from_gpt_oss_checkpoint(path, 3, device=device),
    ):
        with pytest.raises(DeviceError, match="no CUDA device on this machine"):
            load("cuda")
        with pytest.raises(DeviceError, match="'gpu0' is not a device string"):
            load("gpu0")


def test_save_refuses_incomplete_concat_or_dequantized_layers(tmp_path: Path) -> None:
    layer = make_layer(seed=7)
    partial = {k: v for k, v in layer.tensors().items() if k != "b2"}
    with pytest.raises(CheckpointError, match=r"missing \['b2'\]"):
        save_gpt_oss_layer(tmp_path / "m.safetensors", partial, layer=0, naming=CheckpointNaming.HF)
    with pytest.raises(LayoutMismatchError, match="INTERLEAVED"):
        GptOssLayer(
            weights=layer.weights.to_layout(GateLayout.CONCAT),
            router_weight=layer.router_weight,
            router_bias=layer.router_bias,
            naming=CheckpointNaming.HF,
            layer=0,
        )
    with pytest.raises(LayoutMismatchError, match="CHECKPOINT packing"):
        GptOssLayer(
            weights=layer.weights.dequantized(torch.float32),
            router_weight=layer.router_weight,
            router_bias=layer.router_bias,
            naming=CheckpointNaming.HF,
            layer=0,
        )
    # A mapping of roles is written as given and loads back identically.
    path = tmp_path / "m.safetensors"
    save_gpt_oss_layer(path, layer.tensors(), layer=0, naming=CheckpointNaming.OPENAI)
    assert_same_layer(layer, load_gpt_oss_layer(path, layer=0))


# ----- ambiguous checkpoints: refused, never resolved by file order ---------------------------------------
def _index(folder: Path, weight_map: dict[str, str]) -> Path:
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("whole_layer", [True, False], ids=["whole_layer", "one_tensor"])
def test_two_shards_holding_the_same_tensor_are_refused(tmp_path: Path, hf_tensors, whole_layer: bool):
    """Without an index, the copy read used to be whichever file sorted last."""
    first = write(tmp_path / "a.safetensors", hf_tensors)
    other = gpt_oss_layer_tensors(make_layer(seed=8), layer=3, naming=CheckpointNaming.HF)
    second = write(tmp_path / "b.safetensors", other if whole_layer else {KEYS["b2"]: other[KEYS["b2"]]})
    with pytest.raises(CheckpointError, match="ambiguous") as err:
        load_gpt_oss_layer(tmp_path, layer=3)
    msg = str(err.value)
    assert (KEYS["w13"] if whole_layer else KEYS["b2"]) in msg and str(first) in msg and str(second) in msg
    # Another layer's duplicate is not this layer's business: layer 0 loads.
    write(
        tmp_path / "c.safetensors",
        gpt_oss_layer_tensors(make_layer(seed=9, layer=0), layer=0, naming=CheckpointNaming.HF),
    )
    assert load_gpt_oss_layer(tmp_path, layer=0).layer == 0


def test_an_index_that_disagrees_with_its_shards_is_refused(tmp_path: Path, hf_tensors) -> None:
    a = write(tmp_path / "a.safetensors", {k: v for k, v in hf_tensors.items() if k != KEYS["b2"]})
    b = write(tmp_path / "b.safetensors", {KEYS["b2"]: hf_tensors[KEYS["b2"]]})
    right = {k: "a.safetensors" for k in hf_tensors} | {KEYS["b2"]: "b.safetensors"}
    _index(tmp_path, right)
    load_gpt_oss_layer(tmp_path, layer=3)  # consistent: loads
    # The index maps b2 to a shard that lacks it, while another shard it lists holds it.
    _index(tmp_path, right | {KEYS["b2"]: "a.safetensors", "lm_head.weight": "b.safetensors"})
    with pytest.raises(CheckpointError, match="disagree") as err:
        load_gpt_oss_layer(tmp_path, layer=3)
    assert KEYS["b2"] in str(err.value) and str(a) in str(err.value) and str(b) in str(err.value)
    # The index does not list b2 at all, yet a listed shard holds it.
    _index(
        tmp_path, {k: v for k, v in right.items() if k != KEYS["b2"]} | {"lm_head.weight": "b.safetensors"}
    )
    with pytest.raises(CheckpointError, match="does not list it") as err:
        load_gpt_oss_layer(tmp_path, layer=3)
    assert KEYS["b2"] in str(err.value) and str(b) in str(err.value)
    # Two listed shards both hold b2: the index picks one, but the checkpoint holds two versions.
    write(tmp_path / "a.safetensors", hf_tensors)
    _index(tmp_path, right)
    with pytest.raises(CheckpointError, match="stored in 2 files") as err:
        load_gpt_oss_layer(tmp_path, layer=3)
    assert KEYS["b2"] in str(err.value) and str(a) in str(err.value) and str(b) in str(err.value)
    assert "the index" in str(err.value)


def test_an_index_naming_files_outside_its_folder_or_nested_too_deeply_is_refused(tmp_path: Path) -> None:
    _index(tmp_path, {KEYS["w13"]: "../elsewhere.safetensors"})
    with pytest.raises(CheckpointError, match="outside"):
        load_gpt_oss_layer(tmp_path, layer=3)
    (tmp_path / "model.safetensors.index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="weight_map"):
        load_gpt_oss_layer(tmp_path, layer=3)


def test_the_layer_under_both_namings_is_refused_even_with_naming_given(tmp_path: Path, hf_tensors) -> None:
    openai = gpt_oss_layer_tensors(make_layer(seed=6), layer=3, naming=CheckpointNaming.OPENAI)
    path = write(tmp_path / "both.safetensors", hf_tensors | openai)
    with pytest.raises(CheckpointError, match="allow_extra_tensors=True") as err:
        load_gpt_oss_layer(path, layer=3, naming=CheckpointNaming.HF)
    assert EXPECTED_KEYS[CheckpointNaming.OPENAI]["w13"] in str(err.value)
    got = load_gpt_oss_layer(path, layer=3, naming=CheckpointNaming.HF, allow_extra_tensors=True)
    assert torch.equal(got.weights.w13, hf_tensors[KEYS["w13"]])


@pytest.mark.parametrize(
    "extra",
    ["model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.gate_up_proj_blocks_old"],
    ids=["dequantized_copy", "unknown_tensor"],
)
def test_moe_tensors_the_loader_would_not_read_are_refused(tmp_path: Path, hf_tensors, extra: str) -> None:
    path = write(tmp_path / "m.safetensors", hf_tensors | {extra: torch.zeros(E, H, 2 * I)})
    with pytest.raises(CheckpointError, match="silently ignored") as err:
        load_gpt_oss_layer(path, layer=3)
    assert extra in str(err.value)
    assert load_gpt_oss_layer(path, layer=3, allow_extra_tensors=True).layer == 3


def test_tensors_outside_the_moe_block_and_the_openai_block_norm_are_expected(tmp_path: Path) -> None:
    tensors = gpt_oss_layer_tensors(make_layer(seed=11), layer=3, naming=CheckpointNaming.OPENAI)
    tensors |= {"block.3.mlp.norm.scale": torch.ones(H), "block.3.attn.norm.scale": torch.ones(H)}
    path = write(tmp_path / "m.safetensors", tensors)
    assert load_gpt_oss_layer(path, layer=3).naming is CheckpointNaming.OPENAI

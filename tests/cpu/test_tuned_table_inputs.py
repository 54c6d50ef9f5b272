"""Tuned tables from untrusted hands: the writer validates what it writes and refuses files it does not
understand (leaving them byte for byte as they were), and no row content or file shape crashes `plan()`.

The loader and the writer share one row validator (`tuned.parse_row`) and one file reader
(`tuned._read_table`), so "the writer accepts a row" and "the loader uses it" are the same statement;
the fuzz tests below hold both to that over arbitrary JSON values in every field.
"""

import copy
import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moekit
from fake_kernels import SiluGeluOnlyKernel
from moekit import PlanFallbackError, TunedTableError
from moekit.app.cli_spec import SIMULATED_DEVICES
from moekit.kernels.base import DeviceInfo, Problem
from moekit.kernels.registry import default_registry
from moekit.kernels.triton.config import TritonMoEConfig
from moekit.planning.plan import ConfigSource, plan
from moekit.planning.tuned import load_tables, row_to_json, triton_version, write_rows

# silu_gelu_only has the highest priority and cannot compute SWIGLU_OAI: a planner that let a row
# reach it would pick it first.
REGISTRY = default_registry().with_kernels(SiluGeluOnlyKernel())
CPU, H200 = DeviceInfo.of("cpu"), SIMULATED_DEVICES["h200"]
SPEC = replace(moekit.preset("gpt-oss-20b"), num_experts=4, hidden_size=64, intermediate_size=32)


def _good_row(device: DeviceInfo = CPU, tokens: int = 1) -> dict:
    """A row the loader uses: torch_grouped on the CPU, triton_fused on the simulated H200."""
    if device is CPU:
        kernel, config = "torch_grouped", REGISTRY.get("torch_grouped").default_config(SPEC, Problem(1, CPU))
    else:
        kernel, config = "triton_fused", TritonMoEConfig(block_m=32)
    return row_to_json(
        spec=SPEC, device=device.name, triton=triton_version(), tokens=tokens, kernel=kernel, config=config
    )


def _table(path, rows, **top):
    path.write_text(json.dumps({"schema_version": 1, "rows": rows, **top}))
    return path


# ----- the writer refuses files it does not understand ---------------------------------------------------
NOT_UNDERSTOOD = {
    "newer_schema_with_more_keys": (
        json.dumps({"schema_version": 2, "rows": [], "defaults": {"block_m": 64}}),
        "schema_version=2",
    ),
    "older_schema": (json.dumps({"schema_version": 0, "rows": []}), "schema_version=0"),
    "schema_version_true": (json.dumps({"schema_version": True, "rows": []}), "schema_version=True"),
    "no_schema_version": (json.dumps({"rows": []}), "schema_version=None"),
    "unknown_top_level_key": (
        json.dumps({"schema_version": 1, "rows": [], "comment": "x"}),
        "unknown top-level keys ['comment']",
    ),
    "top_level_list": (json.dumps([{"schema_version": 1}]), "top level is a list"),
    "top_level_string": (json.dumps("rows"), "top level is a str"),
    "rows_not_a_list": (json.dumps({"schema_version": 1, "rows": {"0": {}}}), "'rows' must be a list"),
    "rows_missing": (json.dumps({"schema_version": 1}), "'rows' must be a list"),
    "not_json": ("{not json", "unreadable table"),
    "not_utf8": (b"\xff\xfe{}", "unreadable table"),
    "nested_too_deeply": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "repeated_key": ('{"schema_version": 1, "rows": [], "rows": []}', "repeated key(s) ['rows']"),
}


@pytest.mark.parametrize(("content", "fragment"), NOT_UNDERSTOOD.values(), ids=NOT_UNDERSTOOD.keys())
def test_the_writer_refuses_a_file_it_does_not_understand_and_leaves_it_untouched(
    tmp_path, content, fragment
):
    path = tmp_path / "table.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    before = path.read_bytes()
    with pytest.raises(TunedTableError) as err:
        write_rows(path, [_good_row()], registry=REGISTRY)
    message = str(err.value)
    assert str(path) in message and fragment in message and "left unchanged" in message
    assert "another path" in message  # the fix
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json", "table.json.lock"]  # no temp left
    # The loader reads the same file the same way: reported by its path, other tables still load.
    good = _table(tmp_path / "good.json", [_good_row()])
    tables = load_tables([path, good], registry=REGISTRY)
    assert len(tables.rows) == 1 and [r.origin for r in tables.rejected] == [str(path)]
    assert fragment in tables.rejected[0].reason


# ----- the writer validates every row it is given --------------------------------------------------------
def _mutated(changes: dict[str, object]) -> dict:
    """A good row with `changes` ("field" or "spec.field" -> value, or _DELETE) applied."""
    row = _good_row()
    for path, value in changes.items():
        parent, _, leaf = path.rpartition(".")
        target = row[parent] if parent else row
        if value is _DELETE:
            del target[leaf]
        else:
            target[leaf] = value
    return row


_DELETE = object()
BAD_ROWS = {
    "tokens_string": ({"tokens": "8"}, "tokens must be an int, got '8' (str)"),
    "tokens_bool": ({"tokens": True}, "tokens must be an int, got True (bool)"),
    "tokens_float": ({"tokens": 8.0}, "tokens must be an int"),
    "tokens_zero": ({"tokens": 0}, "tokens must be a positive int"),
    "E_string": ({"E": "4"}, "E must be an int, got '4'"),
    "H_bool": ({"H": True}, "H must be an int, got True (bool)"),
    "I_null": ({"I": None}, "I must be an int, got None"),
    "device_list": ({"device": ["cpu"]}, "device must be a non-empty string"),
    "triton_null": ({"triton": None}, "triton must be a non-empty string"),
    "kernel_list": ({"kernel": ["torch_grouped"]}, "kernel must be a non-empty string"),
    "kernel_object": ({"kernel": {}}, "kernel must be a non-empty string"),
    "kernel_unknown": ({"kernel": "no_such_kernel"}, "unknown kernel 'no_such_kernel'"),
    "kernel_incapable": ({"kernel": "silu_gelu_only", "config": {}}, "cannot serve this row"),
    "config_list": ({"config": []}, "must be an object"),
    "config_bool_for_bool_field": ({"config.use_grouped_mm": "false"}, "use_grouped_mm must be a bool"),
    "spec_list": ({"spec": []}, "spec must be an object, got [] (list)"),
    "spec_null": ({"spec": None}, "spec must be an object, got None"),
    "has_bias_string": ({"spec.has_bias": "no"}, "spec.has_bias must be true or false, got 'no'"),
    "has_bias_int": ({"spec.has_bias": 1}, "spec.has_bias must be true or false, got 1 (int)"),
    "expert_map_string": ({"spec.expert_map": "false"}, "spec.expert_map must be true or false"),
    "alpha_string": ({"spec.alpha": "1.702"}, "spec.alpha must be null or a finite number"),
    "alpha_bool": ({"spec.alpha": True}, "spec.alpha must be null or a finite number, got True"),
    "alpha_huge_int": ({"spec.alpha": 10**400}, "spec.alpha must be null or a finite number"),
    "limit_list": ({"spec.limit": [7.0]}, "spec.limit must be null or a finite number"),
    "activation_number": ({"spec.activation": 3}, "spec.activation must be one of"),
    "act_dtype_list": ({"spec.act_dtype": ["bfloat16"]}, "spec.act_dtype must be one of"),
    "fp8_scale_object": ({"spec.fp8_scale": {}}, "spec.fp8_scale must be one of"),
    "spec_unknown_field": ({"spec.alpah": 1.702}, "spec has unknown fields ['alpah']"),
    "spec_missing_field": ({"spec.gate_layout": _DELETE}, "lacks fields ['gate_layout']"),
    "row_unknown_field": ({"token": 8}, "unknown fields ['token']"),
    "row_missing_field": ({"config": _DELETE}, "missing fields ['config']"),
}


@pytest.mark.parametrize(("changes", "fragment"), BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_the_writer_refuses_a_row_the_loader_would_reject(tmp_path, changes, fragment):
    path = write_rows_once(tmp_path)
    before = path.read_bytes()
    bad = _mutated(changes)
    with pytest.raises(TunedTableError) as err:
        write_rows(path, [_good_row(tokens=2), bad], registry=REGISTRY)
    message = str(err.value)
    assert str(path) in message and "new row 1" in message and fragment in message
    assert "row_to_json" in message  # the fix
    assert path.read_bytes() == before  # nothing written, not even the good row
    fresh = tmp_path / "fresh.json"
    with pytest.raises(TunedTableError):
        write_rows(fresh, [bad], registry=REGISTRY)
    assert not fresh.exists()
    # The loader rejects the same row with the same reason, by name, and plans with a capable default.
    tables = load_tables([_table(tmp_path / "t.json", [bad])], registry=REGISTRY)
    assert not tables.rows and tables.rejected[0].origin.endswith("#row 0")
    assert fragment in tables.rejected[0].reason


def write_rows_once(tmp_path):
    path = tmp_path / "table.json"
    write_rows(path, [_good_row()], registry=REGISTRY)
    return path


def test_a_new_row_replaces_the_row_of_its_token_bucket(tmp_path):
    """T=3 and T=4 share bucket 4: writing both must leave one row the loader uses, not two rows that
    it rejects as an ambiguous duplicate."""
    path = tmp_path / "table.json"
    write_rows(path, [_good_row(tokens=3)], registry=REGISTRY)
    write_rows(path, [_good_row(tokens=4)], registry=REGISTRY)
    assert [r["tokens"] for r in json.loads(path.read_text())["rows"]] == [4]
    tables = load_tables([path], registry=REGISTRY)
    assert len(tables.rows) == 1 and not tables.rejected
    with pytest.raises(TunedTableError, match="two new rows share a key"):
        write_rows(path, [_good_row(tokens=5), _good_row(tokens=7)], registry=REGISTRY)


def test_the_writer_keeps_existing_rows_it_cannot_validate(tmp_path):
    """A row for a kernel this process lacks (or a stale one) is not the writer's to drop."""
    foreign = _good_row(tokens=64)
    foreign["kernel"] = "a_kernel_registered_elsewhere"
    junk = {"not": "a row"}
    path = _table(tmp_path / "table.json", [foreign, junk])
    write_rows(path, [_good_row(tokens=1)], registry=REGISTRY)
    assert json.loads(path.read_text())["rows"] == [foreign, junk, _good_row(tokens=1)]


# ----- plan() never crashes on a row or a file -----------------------------------------------------------
@pytest.mark.parametrize(("changes", "fragment"), BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_a_bad_row_is_reported_by_plan_and_explain_never_raised(tmp_path, changes, fragment):
    path = _table(tmp_path / "t.json", [_mutated(changes)])
    result = plan(SPEC, num_tokens=1, device="cpu", tuned=path, registry=REGISTRY)
    assert result.kernel == "torch_grouped" and result.source is ConfigSource.DEFAULT
    assert f"{path}#row 0" in result.explain() and fragment in result.explain()
    with pytest.raises(PlanFallbackError, match="rejected tuned rows|kernel default"):
        plan(SPEC, num_tokens=1, device="cpu", tuned=path, registry=REGISTRY, strict=True)


def test_a_deeply_nested_file_is_reported_by_plan(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    result = plan(SPEC, num_tokens=1, device="cpu", tuned=path, registry=REGISTRY)
    assert result.kernel == "torch_grouped" and result.source is ConfigSource.DEFAULT
    assert f"{path}: unreadable table: JSON nested too deeply" in result.explain()
    deep_row = _table(tmp_path / "deep_row.json", [_mutated({"config": json.loads("[" * 500 + "]" * 500)})])
    assert "#row 0" in plan(SPEC, num_tokens=1, device="cpu", tuned=deep_row, registry=REGISTRY).explain()


# ----- fuzz: any JSON value in any field ------------------------------------------------------------------
# Values near the valid ones (enum strings, kernel names, small and huge ints) reach the deeper checks;
# arbitrary JSON reaches the type checks.
NEAR_VALID = st.sampled_from(
    [
        *(v for enum_type in (moekit.WeightFormat, moekit.Activation, moekit.GateLayout) for v in enum_type),
        "bfloat16",
        "float32",
        "none",
        "output",
        "input",
        "per_tensor",
        "torch_grouped",
        "triton_fused",
        "reference",
        "silu_gelu_only",
        "cpu",
        "NVIDIA H200",
        triton_version(),
    ]
).map(lambda v: getattr(v, "value", v))
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-3, 300)
    | st.integers(2**31 - 2, 2**64)
    | st.floats()
    | st.text(max_size=8)
    | NEAR_VALID,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "device",
    "triton",
    "spec",
    "E",
    "K",
    "H",
    "I",
    "tokens",
    "kernel",
    "config",
    *(f"spec.{name}" for name in _good_row()["spec"]),
    *(f"config.{name}" for name in TritonMoEConfig().as_dict()),
    "config.use_grouped_mm",
    "config.block_m",
    "extra_field",
    "spec.extra_field",
]


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    device=st.sampled_from([CPU, H200]),
    changes=st.dictionaries(st.sampled_from(FIELDS), JSON, min_size=1, max_size=3),
    kernel=st.sampled_from(["torch_grouped", "triton_fused", "silu_gelu_only", "reference"]),
    tokens=st.integers(1, 64),
    strict=st.booleans(),
)
def test_fuzzed_rows_never_crash_plan_nor_pick_an_incapable_kernel(
    tmp_path_factory, device, changes, kernel, tokens, strict
):
    row = _good_row(device)
    row["kernel"] = kernel
    for field, value in changes.items():
        parent, _, leaf = field.rpartition(".")
        target = row[parent] if parent else row
        if isinstance(target, dict):  # an earlier change may have replaced the parent
            target[leaf] = copy.deepcopy(value)
    folder = tmp_path_factory.mktemp("fuzz")
    path = folder / "t.json"
    path.write_text(json.dumps({"schema_version": 1, "rows": [row]}))
    tables = load_tables([path], registry=REGISTRY)  # never raises
    accepted = bool(tables.rows)
    assert accepted != bool(tables.rejected)
    try:
        result = plan(SPEC, num_tokens=tokens, device=device, tuned=tables, registry=REGISTRY, strict=strict)
    except PlanFallbackError:
        assert strict
    else:
        chosen = REGISTRY.get(result.kernel)
        assert chosen.supports(SPEC, Problem(tokens, device)) is None
        assert chosen.validate_config(result.config, SPEC) is None
        if tables.rejected and tables.rejected[0].key is None:  # a row of unknown key: every plan shows it
            assert f"{path}#row 0" in result.explain()
    # The writer accepts exactly the rows the loader accepts.
    target = folder / "written.json"
    try:
        write_rows(target, [row], registry=REGISTRY)
    except TunedTableError as err:
        assert not accepted and str(target) in str(err)
        assert not target.exists()
    else:
        assert accepted
        assert len(load_tables([target], registry=REGISTRY).rows) == 1

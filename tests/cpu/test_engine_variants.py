"""benchmarks/engine_variants.py on the CPU: its case syntax and that a variant module loads apart from
the shipped kernels (the timing itself needs a GPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "engine_variants", ROOT / "benchmarks" / "engine_variants.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves its own module
    spec.loader.exec_module(module)
    return module


def test_a_case_names_a_reshaped_preset_its_tokens_and_pairs():
    tool = _tool()
    case = tool.Case.parse("gpt-oss-120b@8x2x4096x14336:4096:256")
    assert case == tool.Case("gpt-oss-120b@8x2x4096x14336", 4096, 256)
    with pytest.raises(ValueError):
        tool.Case.parse("gpt-oss-120b:many:128")


def test_a_variant_module_loads_under_its_own_name(tmp_path):
    pytest.importorskip("triton.experimental.gluon")
    shipped = ROOT / "src" / "moekit" / "kernels" / "triton" / "_details" / "wgmma_words.py"
    copy = tmp_path / "variant.py"
    copy.write_text(shipped.read_text())
    module = _tool().load_variant("copy", copy)
    from moekit.kernels.triton._details import wgmma_words

    assert module.__name__ == "engine_variant_copy" and module._gemm1 is not wgmma_words._gemm1

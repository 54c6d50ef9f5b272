"""The W4A8 byte-permute decode probe (`tools/w4a8_lut.py`, `tools/w4a8_lut_probe.py`), on the CPU.

The table model against exact arithmetic (every code at every exact drop, then random words), the kernel's
sign mask as the model's, and the probe's Gluon kernel compiled for sm_90 in each variant without a
spill, so that the probe keeps working as a starting point for a W4A8 engine.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import w4a8_lut  # noqa: E402


def test_table_decodes_every_code_exactly_to_the_last_exact_drop():
    assert w4a8_lut.check(words=2000, seed=1) == 0


def test_one_drop_past_the_exact_range_is_not_exact():
    # The table's claim is tight: at d = 12 the smallest magnitude leaves the E4M3 normals.
    d = w4a8_lut.MAX_EXACT_DROP + 1
    word = int(w4a8_lut.pack_words(torch.full((1, 8), 1, dtype=torch.uint8))[0, 0]) & 0xFFFFFFFF
    got = torch.tensor(w4a8_lut.decode_word(word, d), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert got[0].item() != 0.5 * 2.0 ** (6 - d)


def test_signed_mask_is_the_unsigned_one():
    assert w4a8_lut._SIGNS_INT32 & 0xFFFFFFFF == w4a8_lut._SIGNS


_COMPILE = """
import json
import sass_report
import w4a8_lut_probe as probe
out = []
for stages, work in probe.VARIANTS:
    kernel = probe.compile_offline(2944, stages, work)
    facts = sass_report.kernel_facts(kernel)
    out.append(dict(variant=[stages, work.name], shared=kernel.metadata.shared, **facts))
print(json.dumps(out))
"""


def test_probe_kernel_compiles_for_sm90_without_spills():
    pytest.importorskip("triton")
    from compiled_json import compiled_json

    for facts in compiled_json(["-c", _COMPILE]):
        assert facts["local_bytes"] == 0 and facts["local_memory_ops"] == 0, facts
        assert facts["shared"] <= 227 * 1024, facts  # one program an SM fits

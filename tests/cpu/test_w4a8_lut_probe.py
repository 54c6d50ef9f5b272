"""The W4A8 decode probes (`tools/w4a8_lut.py`, `tools/w4a8_lut_probe.py`, `tools/w4a8_swap_probe.py`), on
the CPU.

The table model against exact arithmetic (every code at every exact drop, then random words), the kernel's
sign mask as the model's, the register-A probe's offline packing (words in fragment order; drops and
factors) against the fragment positions its kernel reads and the dequantized weights, and both probes' Gluon
kernels compiled for sm_90 in each variant without a spill (the register-A
one also without repacking its fragment), so that the probes keep working as a starting point for a W4A8
engine.
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


def _fragment_columns(n: int, k: int) -> torch.Tensor:
    """Where each packed word's 8 bytes land: [N / 16, K / 128, 32, 8, 8] -> (row, column) as
    `w4a8_swap_probe.py` documents (row 16 rb + 8 h + g, column 128 t + 32 c + 16 kh + 4 q + byte)."""
    rb, t, lane, slot, code = torch.meshgrid(
        *(torch.arange(size) for size in (n // 16, k // 128, 32, 8, 8)), indexing="ij"
    )
    g, q, c, h, kh, byte = lane // 4, lane % 4, slot // 2, slot % 2, code // 4, code % 4
    return 16 * rb + 8 * h + g, 128 * t + 32 * c + 16 * kh + 4 * q + byte


def test_fragment_packing_places_every_code_where_the_kernel_reads_it():
    swap_probe = pytest.importorskip("w4a8_swap_probe")  # imports Triton's Gluon
    generator = torch.Generator().manual_seed(2)
    n, k = 32, 256
    codes = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8)
    words = swap_probe.pack_fragment_words(codes)
    assert words.shape == (n // 16, k // 128, 32, 8)
    decoded = torch.tensor(
        [w4a8_lut.decode_word(int(w) & 0xFFFFFFFF, 6) for w in words.flatten()], dtype=torch.uint8
    )  # d = 6: each byte is the code's E2M1 value itself
    values = decoded.view(torch.float8_e4m3fn).float().reshape(n // 16, k // 128, 32, 8, 8)
    rows, cols = _fragment_columns(n, k)
    want = torch.tensor(w4a8_lut.E2M1)[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    assert torch.equal(values, want[rows, cols])
    placed = torch.zeros(n, k, dtype=torch.int32).index_put_(
        (rows.flatten(), cols.flatten()), torch.tensor(1, dtype=torch.int32), accumulate=True
    )
    assert torch.equal(placed, torch.ones_like(placed))  # every code exactly once


_COMPILE_SWAP = """
import json
import sass_report
import w4a8_swap_probe as probe
out = []
for bn, stages, loop, pre, ws in probe.VARIANTS:
    kernel = probe.compile_offline(2944, bn, stages, loop, pre, ws)
    facts = sass_report.kernel_facts(kernel)
    repacks = kernel.asm["ptx"].count("0x3340")
    variant = [bn, stages, loop, pre, ws]
    out.append(dict(variant=variant, shared=kernel.metadata.shared, repacks=repacks, **facts))
print(json.dumps(out))
"""


def test_swap_probe_builds_its_fragment_without_repacking_or_spills():
    pytest.importorskip("triton")
    from compiled_json import compiled_json

    for facts in compiled_json(["-c", _COMPILE_SWAP]):
        assert facts["local_bytes"] == 0 and facts["local_memory_ops"] == 0, facts
        # the decoded int32 registers are the fragment's: no byte pairs packed back by PRMT 0x3340
        assert facts["repacks"] == 0, facts


@pytest.mark.parametrize("steps_per_reference", [1, 2])
def test_packed_drops_and_factors_rebuild_the_weights(steps_per_reference):
    """What a PRE kernel computes from the packing (each code's table byte at its group's drop, times its
    reference's factor) is the dequantized weight, except in groups flushed for being more than 11 binades
    below their reference, which decode to zero."""
    swap_probe = pytest.importorskip("w4a8_swap_probe")
    generator = torch.Generator().manual_seed(3)
    n, k = 16, 384  # three K-steps: with pairs, the last reference is one step
    codes, scale_bytes = w4a8_lut.random_mxfp4(n, k, generator)
    scale_bytes[3, 5] = 100  # 18 - 27 binades below its row's other groups: flushed
    drops, factors, flushed = swap_probe.pack_drops(scale_bytes, steps_per_reference)
    assert flushed[3, 5] and int(flushed.sum()) == 1
    assert drops.shape == (n, k // 128) and factors.shape == (n, -(-k // (128 * steps_per_reference)))
    kept = torch.where(flushed.repeat_interleave(32, dim=1), 0, codes)
    words = swap_probe.pack_fragment_words(kept)
    group_drops = drops.view(torch.uint8).reshape(n, k // 32).long()
    rows, cols = _fragment_columns(n, k)
    got = torch.empty(n, k)
    for index, word in enumerate(words.flatten().tolist()):
        rb, t, lane, slot = torch.unravel_index(torch.tensor(index), words.shape)
        row, col = rows[rb, t, lane, slot, 0].item(), cols[rb, t, lane, slot, 0].item()
        d = group_drops[row, col // 32].item()
        values = torch.tensor(w4a8_lut.decode_word(word & 0xFFFFFFFF, d), dtype=torch.uint8)
        factor = factors[row, col // (128 * steps_per_reference)].double()
        # the kernel's 2^(s_max - 133) times the table's 2^(6 - d) scaling: 2^(s - 127)
        got[row, cols[rb, t, lane, slot].tolist()] = (
            values.view(torch.float8_e4m3fn).double() * factor
        ).float()
    want = w4a8_lut.dequantize(codes, scale_bytes)
    want[3, 5 * 32 : 6 * 32] = 0.0
    assert torch.equal(got, want)

"""The Triton fused-MoE path run by the Triton interpreter on the CPU, against the reference.

Tiers: routing-metadata invariants (torch only); bit-exact FP8 activation quantization against
moekit.formats; then the layer for every weight format x activation (with and without clamp) x gate
layout x bias x router placement, on fresh random data, with every buffer the path allocates poisoned
(NaN / garbage ints) so that a read of a padding row, a dropped pair or a masked column shows.

The interpreter's bf16 arithmetic is broken, so activations are fp32 (exact comparison) or fp16.
Shapes are tiny: the interpreter runs each program in numpy.
"""


# TRITON_INTERPRET is decided once per process, by tests/conftest.py (set without CUDA). Never here: on a
# CUDA machine, setting it while collecting this module would make every Triton module imported after it
# interpreted in the process that runs the compiled GPU tests.

import contextlib  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402
from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moekit import (  # noqa: E402
    Activation,
    ActivationQuant,
    ActivationSpec,
    DTypeError,
    ExpertWeights,
    Fp8Scale,
    GateLayout,
    MoESpec,
    RouterWeightPlacement,
    RoutingResult,
    RoutingSpec,
    ShapeError,
    SpecError,
    WeightFormat,
    fused_moe_reference,
    route,
)
from moekit.formats import quantize_fp8_activation  # noqa: E402
from moekit.kernels.base import DeviceInfo, DeviceKind  # noqa: E402
from moekit.kernels.triton import align, launch  # noqa: E402
from moekit.kernels.triton._details import gemm as _jit  # noqa: E402
from moekit.kernels.triton._details import mxfp4 as _jit_mxfp4
from moekit.kernels.triton._details import quant as _jit_quant  # noqa: E402
from moekit.kernels.triton.align import (  # noqa: E402
    ONE_PROGRAM_MAX_PAIRS,
    AlignMethod,
    align_routing,
    gemm_blocks,
    max_blocks_bound,
    one_block_per_pair,
    pair_rows,
    paired_blocks,
    split_tail_blocks,
)
from moekit.kernels.triton.block_choice import expected_repeats, takes_one_block_per_pair  # noqa: E402
from moekit.kernels.triton.config import TritonMoEConfig, triton_supports  # noqa: E402
from moekit.kernels.triton.launch import triton_fused_moe  # noqa: E402
from moekit.kernels.triton.quantize import quantize_rows  # noqa: E402
from moekit.kernels.triton.tuning import default_config  # noqa: E402
from moekit.kernels.triton.tuning_space import tuning_space  # noqa: E402
from moekit.presets import preset_at  # noqa: E402
from moekit.reference import relative_l2_error, tolerance  # noqa: E402
from moekit.weights import WeightPacking  # noqa: E402

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - layout of triton internals
    InterpretedFunction = None
if InterpretedFunction is None or not isinstance(_jit._moe_gemm1, InterpretedFunction):
    pytest.skip(
        "moekit's Triton kernels were imported without TRITON_INTERPRET=1 in this process (a CUDA "
        "machine): test_interpreter_suite.py runs this file in a child pytest with CUDA hidden",
        allow_module_level=True,
    )

pytestmark = pytest.mark.interpret

# Relative L2 error against the fp32 reference, by activation dtype. fp32: summation order only (FP8 and
# MXFP4 dequantize exactly as the reference does, and W8A8 quantizes the same fp32 values); fp16 rounds
# x, h, the per-pair outputs and out.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}
TINY = TritonMoEConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
# Weights on the MMA's M side (decode path); BLOCK_N != BLOCK_M so a swapped orientation cannot hide.
TINY_SWAP = TritonMoEConfig(
    block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=2, swap_ab=True
)


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _spec(
    *,
    fmt=WeightFormat.FP32,
    scale=None,
    quant=ActivationQuant.NONE,
    dtype=torch.float32,
    e=6,
    k=2,
    h=64,
    i=48,
    act=None,
    layout=GateLayout.CONCAT,
    bias=True,
    placement=RouterWeightPlacement.OUTPUT,
    e_local=None,
) -> MoESpec:
    act = act or ActivationSpec(Activation.SILU)
    return MoESpec(
        num_experts=e,
        top_k=k,
        hidden_size=h,
        intermediate_size=i,
        weight_format=fmt,
        fp8_scale=scale,
        act_dtype=dtype,
        act_quant=quant,
        activation=act,
        gate_layout=layout,
        has_bias=bias,
        router_weight_placement=placement,
        routing=RoutingSpec(),
        num_local_experts=e_local,
    )


def _weights(spec: MoESpec, gen: torch.Generator) -> ExpertWeights:
    """Fresh random weights (never zeros; gate and up rows differ) quantized into the spec's format."""
    e, h, i = spec.E_local, spec.H, spec.I
    w13 = torch.randn(e, 2 * i, h, generator=gen) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=gen) / math.sqrt(i)
    bias = {}
    if spec.has_bias:
        bias = dict(
            b13=(0.3 * torch.randn(e, 2 * i, generator=gen)).to(spec.act_dtype),
            b2=(0.3 * torch.randn(e, h, generator=gen)).to(spec.act_dtype),
        )
    return ExpertWeights.from_float(
        w13=w13,
        w2=w2,
        format=spec.weight_format,
        gate_layout=spec.gate_layout,
        fp8_scale=spec.fp8_scale,
        **bias,
    )


def _routing(spec: MoESpec, t: int, gen: torch.Generator) -> RoutingResult:
    return route(torch.randn(t, spec.E, generator=gen), top_k=spec.K, spec=spec.routing)


@contextlib.contextmanager
def _poisoned_allocations():
    """Make torch.empty return NaN (floats) / 0x7F (fp8 NaN) / -7 (ints) instead of whatever memory held."""
    real_empty = torch.empty

    def empty(*size, dtype=None, **kwargs):
        t = real_empty(*size, dtype=dtype, **kwargs)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point():
            t.fill_(math.nan)
        elif t.dtype != torch.bool:
            t.fill_(-7)
        return t

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real_empty


def _check_layer(
    spec, *, t=5, seed=0, config=TINY, weights=None, routing=None, expert_map=None, x=None, tol=None
):
    gen = torch.Generator().manual_seed(seed)
    weights = weights if weights is not None else _weights(spec, gen)
    x = x if x is not None else torch.randn(t, spec.H, generator=gen).to(spec.act_dtype)
    routing = routing if routing is not None else _routing(spec, x.shape[0], gen)
    expected = fused_moe_reference(x, weights, routing, spec=spec, expert_map=expert_map)
    out = torch.full((x.shape[0], spec.H), math.nan, dtype=spec.act_dtype)
    with _poisoned_allocations():
        got = triton_fused_moe(x, weights, routing, spec=spec, config=config, expert_map=expert_map, out=out)
    assert got is out and got.shape == expected.shape and got.dtype == spec.act_dtype
    assert torch.isfinite(got).all(), f"non-finite output for {spec.describe()}"
    err = relative_l2_error(got, expected)
    tol = TOLERANCE[spec.act_dtype] if tol is None else tol
    assert err <= tol, f"rel L2 {err:.2e} for {spec.describe()}"
    return got, expected


# ---------------------------------------------------------------------------------------------------------
# routing metadata (torch only)
# ---------------------------------------------------------------------------------------------------------
def _takes(t, k, e, nbytes, *, has_map=False):
    return takes_one_block_per_pair(
        num_tokens=t, top_k=k, num_local_experts=e, has_expert_map=has_map, expert_bytes=nbytes
    )


@pytest.mark.parametrize("e", [8, 32, 128, 256, 384, 512])
@pytest.mark.parametrize("k", [1, 2, 4, 8, 10])
@pytest.mark.parametrize("nbytes", [2**20, 9_437_184, 44_040_192])
def test_one_block_per_pair_for_one_token_or_few_expected_repeats(e, k, nbytes):
    """One token always (its K experts are distinct), never with an expert map (pairs of other ranks);
    beyond, up to a token count that falls as the experts grow in bytes and rises with their number."""
    taken = [t for t in range(0, 400) if _takes(t, k, e, nbytes)]
    assert 0 not in taken and 1 in taken
    assert taken == list(range(1, taken[-1] + 1)), "more tokens never turn the rule back on"
    assert not any(_takes(t, k, e, nbytes, has_map=True) for t in range(0, 50))
    assert all(_takes(t, k, 2 * e, nbytes) for t in taken), "more experts at the same pairs: still taken"
    assert all(not _takes(t, k, e, 2 * nbytes) or t in taken for t in range(1, 400))
    # However small the experts, never past one pair for every 4 of them (a program per pair).
    assert all(t == 1 or 4 * t * k <= e for t in taken)
    assert all(_takes(t, k, e, 1) == (t == 1 or 4 * t * k <= e) for t in range(1, 400))


def test_expected_repeats_of_uniform_routing():
    assert expected_repeats(num_pairs=1, num_local_experts=64) == 0
    assert expected_repeats(num_pairs=2, num_local_experts=2) == pytest.approx(0.5)
    gen = torch.Generator().manual_seed(3)
    draws = torch.randint(0, 256, (20000, 32), generator=gen)
    repeats = 32 - torch.tensor([len(set(row.tolist())) for row in draws], dtype=torch.float64).mean()
    assert expected_repeats(num_pairs=32, num_local_experts=256) == pytest.approx(float(repeats), rel=0.03)


@pytest.mark.parametrize(
    ("name", "tokens", "takes"),
    [
        ("qwen3-30b-a3b@512x10x2048x512", (2, 4, 6, 8), True),
        ("qwen3-30b-a3b", (2, 3), True),
        ("qwen3-30b-a3b", (4,), False),
        ("qwen3-30b-a3b@256x8x2048x768", (2, 4), True),
        ("gpt-oss-120b", (2, 4), True),
        ("deepseek-v3", (2,), True),
        ("deepseek-v3", (4,), False),
    ],
)
def test_one_block_per_pair_takes_the_measured_winners(name, tokens, takes):
    """The path that was faster on an H200 (whole layer, both paths interleaved in one call; the constants
    of `block_choice.takes_one_block_per_pair`), where the margin was over 2 %, or DeepSeek-V3's even
    T = 2."""
    spec = preset_at(name)
    for t in tokens:
        assert _takes(t, spec.K, spec.E, spec.expert_weight_bytes) is takes, (name, t)


def test_one_block_per_pair_reads_the_ids_as_they_are():
    ids = torch.tensor([[7, 2], [7, 0]], dtype=torch.int32)
    blocks = one_block_per_pair(ids, block_m=16)
    assert blocks.block_expert.tolist() == [7, 2, 7, 0] and blocks.max_blocks == 4
    assert blocks.block_start is None and blocks.num_valid_blocks is None and blocks.block_m == 16
    with pytest.raises(DTypeError, match="int32"):
        one_block_per_pair(ids.long(), block_m=16)
    with pytest.raises(ShapeError, match=r"\[T, K\], got shape \(4,\)"):  # before T and K are read
        gemm_blocks(
            ids.reshape(-1),
            num_local_experts=64,
            block_m=16,
            tail_block_m=None,
            expert_map=None,
            expert_bytes=1,
        )


ALIGN_CASES = [
    # (T, K, E, E_local, block_m, why)
    (1, 1, 4, None, 16, "a single pair"),
    (1, 4, 128, None, 128, "one token's pairs in 128-row blocks: 512 padding rows on the fill's lanes"),
    (3, 3, 64, None, 512, "4608 padding rows: the fill in passes of its 1024 lanes"),
    (5, 2, 6, None, 16, "several experts, most with one block"),
    (17, 4, 8, None, 16, "an expert past one block"),
    (40, 2, 8, 5, 16, "expert map with -1 entries"),
    (33, 3, 3, None, 4, "every expert hit, small blocks"),
    (64, 8, 128, None, 64, "many zero-token experts, block larger than any count"),
    (300, 4, 16, None, 16, "P = 1200: five chunks of 256, past the one-program limit"),
    (200, 4, 128, 100, 32, "P = 800 in thirteen chunks of 64, expert map"),
]


def _align_case(t, k, e, e_local):
    gen = torch.Generator().manual_seed(t * 100 + k)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    expert_map, n_local = None, e
    if e_local is not None:
        owners = torch.randperm(e, generator=gen)[:e_local]
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[owners] = torch.arange(e_local, dtype=torch.int32)
        n_local = e_local
    return ids, expert_map, n_local


@pytest.mark.parametrize("method", list(AlignMethod), ids=lambda m: m.name)
@pytest.mark.parametrize(("t", "k", "e", "e_local", "bm", "why"), ALIGN_CASES)
def test_align_invariants(t, k, e, e_local, bm, why, method):
    if method is AlignMethod.ONE_PROGRAM and t * k > ONE_PROGRAM_MAX_PAIRS:
        with pytest.raises(ShapeError, match="one-program"):
            align_routing(
                torch.zeros(t, k, dtype=torch.int32), num_local_experts=e, block_m=bm, method=method
            )
        return
    ids, expert_map, n_local = _align_case(t, k, e, e_local)
    with _poisoned_allocations():
        a = align_routing(ids, num_local_experts=n_local, block_m=bm, expert_map=expert_map, method=method)
    local = ids.reshape(-1).long() if expert_map is None else expert_map.long()[ids.reshape(-1).long()]
    assert torch.equal(a.pair_expert, local.to(torch.int32))
    num_pairs = t * k
    assert a.num_pairs == num_pairs and a.max_blocks == max_blocks_bound(
        num_pairs=num_pairs, num_local_experts=n_local, block_m=bm
    )
    counts = torch.bincount(local[local >= 0], minlength=n_local)
    assert torch.equal(a.expert_counts.long(), counts)
    blocks = int(sum(math.ceil(c / bm) for c in counts.tolist()))
    assert int(a.num_valid_blocks) == blocks <= a.max_blocks
    rows = a.sorted_pair_ids.long().view(a.max_blocks, bm)
    seen = []
    for b in range(blocks):
        expert = int(a.block_expert[b])
        valid = rows[b] < num_pairs
        block = rows[b][valid]
        assert block.numel() > 0, f"block {b} holds no pair"
        # Pairs first, padding last: the WGMMA_WORDS half-wide kernels read row bm / 2 as the block's fill.
        assert valid[: block.numel()].all(), f"block {b} has padding before a pair"
        assert (local[block] == expert).all(), f"block {b} mixes experts"
        seen.append(block)
    # Every local pair exactly once, in increasing pair order within an expert; the rest is padding.
    seen = torch.cat(seen)
    assert torch.equal(seen.sort().values, (local >= 0).nonzero().flatten())
    for expert in range(n_local):
        mine = seen[local[seen] == expert]
        assert torch.equal(mine, mine.sort().values)
    assert (rows[blocks:] == num_pairs).all()
    assert (a.block_expert[blocks:] == n_local).all()
    assert a.expert_offsets.dtype == torch.int64 and int(a.expert_offsets[-1]) == blocks * bm
    padded = torch.cat([torch.zeros(1, dtype=torch.long), ((counts + bm - 1) // bm * bm).cumsum(0)])
    assert torch.equal(a.expert_offsets, padded)


# Each alignment method with the launch's 64 big blocks a program; the chunked one also with 2, which
# spreads the block lists over several programs (the split kernel is the same after every method).
_BLOCK_LIST_RUNS = [*((m, 64) for m in AlignMethod), (AlignMethod.CHUNKED, 2)]


def _aligned(t, k, e, e_local, bm, method):
    """The alignment of an ALIGN_CASES row by `method`, its outputs poisoned before the kernels write."""
    ids, expert_map, n_local = _align_case(t, k, e, e_local)
    with _poisoned_allocations():
        return align_routing(ids, num_local_experts=n_local, block_m=bm, expert_map=expert_map, method=method)


def _block_list_rows(blocks):
    """{(first row, expert)} of a BlockList's valid blocks."""
    n = int(blocks.num_valid_blocks)
    starts = (
        blocks.block_start[:n].tolist()
        if blocks.block_start is not None
        else [b * blocks.block_m for b in range(n)]
    )
    return sorted(zip(starts, blocks.block_expert[:n].tolist(), strict=True))


@pytest.mark.parametrize(
    ("method", "big_tile"), _BLOCK_LIST_RUNS, ids=lambda v: getattr(v, "name", f"tile-{v}")
)
@pytest.mark.parametrize(("t", "k", "e", "e_local", "bm", "why"), ALIGN_CASES)
def test_tail_block_lists(t, k, e, e_local, bm, why, method, big_tile, monkeypatch):
    """`split_tail_blocks`: every valid block of the alignment is covered exactly once, by a 2*bm block
    (two of the same expert's blocks, the first at an even position in its segment) or by a tail block
    (the expert's last, at an even position: an odd number of blocks); the Triton programs and the torch
    specification give the same lists. Two big blocks a program spread them over several programs."""
    if method is AlignMethod.ONE_PROGRAM and t * k > ONE_PROGRAM_MAX_PAIRS:
        return
    monkeypatch.setattr(align, "_BIG_TILE", big_tile)
    a = _aligned(t, k, e, e_local, bm, method)
    with _poisoned_allocations():
        big, tail = split_tail_blocks(a, method=method)
    assert (big.block_m, tail.block_m) == (2 * bm, bm)
    assert big.max_blocks == a.max_blocks // 2
    assert tail.max_blocks == min(a.expert_counts.numel(), a.max_blocks)
    covered = []
    for blocks in (big, tail):
        assert int(blocks.num_valid_blocks) <= blocks.max_blocks
        for first, expert in _block_list_rows(blocks):
            assert first % bm == 0
            for b in range(first // bm, (first + blocks.block_m) // bm):
                assert int(a.block_expert[b]) == expert, f"block {b} is not expert {expert}'s"
                covered.append(b)
            position = (first - int(a.expert_offsets[expert])) // bm
            assert position % 2 == 0
            last = math.ceil(int(a.expert_counts[expert]) / bm) - 1
            assert (position == last) == (blocks is tail)
    assert sorted(covered) == list(range(int(a.num_valid_blocks)))
    spec_big, spec_tail = split_tail_blocks(a, method=AlignMethod.TORCH)
    assert _block_list_rows(big) == _block_list_rows(spec_big)
    assert _block_list_rows(tail) == _block_list_rows(spec_tail)


@pytest.mark.parametrize(
    ("method", "big_tile"), _BLOCK_LIST_RUNS, ids=lambda v: getattr(v, "name", f"tile-{v}")
)
@pytest.mark.parametrize(("t", "k", "e", "e_local", "bm", "why"), ALIGN_CASES)
def test_paired_block_list(t, k, e, e_local, bm, why, method, big_tile, monkeypatch):
    """`paired_blocks`: every valid block of the alignment is covered exactly once, by a 2*bm block
    starting at an even position of its expert's segment: both halves the expert's, or (an odd number
    of blocks) the first half its last block, the second past the expert's end; within the host bound;
    the Triton programs and the torch specification give the same list."""
    if method is AlignMethod.ONE_PROGRAM and t * k > ONE_PROGRAM_MAX_PAIRS:
        return
    monkeypatch.setattr(align, "_BIG_TILE", big_tile)
    a = _aligned(t, k, e, e_local, bm, method)
    with _poisoned_allocations():
        paired = paired_blocks(a, method=method)
    assert paired.block_m == 2 * bm and int(paired.num_valid_blocks) <= paired.max_blocks
    covered = []
    for first, expert in _block_list_rows(paired):
        end = int(a.expert_offsets[expert + 1])
        position = (first - int(a.expert_offsets[expert])) // bm
        assert first % bm == 0 and position % 2 == 0 and first < end
        last = math.ceil(int(a.expert_counts[expert]) / bm) - 1
        half = position == last
        assert half == (first + bm == end), "only an expert's odd last block has its second half past its end"
        for b in range(first // bm, first // bm + (1 if half else 2)):
            assert int(a.block_expert[b]) == expert, f"block {b} is not expert {expert}'s"
            covered.append(b)
    assert sorted(covered) == list(range(int(a.num_valid_blocks)))
    assert _block_list_rows(paired) == _block_list_rows(paired_blocks(a, method=AlignMethod.TORCH))


TAIL = TritonMoEConfig(
    block_m=32, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2, tail_block_m=16
)


@pytest.mark.parametrize("fmt", [WeightFormat.FP16, WeightFormat.MXFP4], ids=lambda f: f.name)
def test_tail_blocks_match_the_reference(fmt):
    """tail_block_m: experts with 0, 5, 16, 17, 32, 33, 47 and 64 pairs (16-row blocks: 0 - 4 of them)
    run as 32-row blocks plus, for an odd count of 16-row blocks, one 16-row tail block each."""
    act = ActivationSpec.gpt_oss() if fmt is WeightFormat.MXFP4 else ActivationSpec(Activation.SILU)
    layout = GateLayout.INTERLEAVED if fmt is WeightFormat.MXFP4 else GateLayout.CONCAT
    dtype = torch.float32 if fmt is WeightFormat.MXFP4 else torch.float16
    spec = _spec(fmt=fmt, dtype=dtype, e=8, k=1, act=act, layout=layout)
    counts = [0, 5, 16, 17, 32, 33, 47, 64]
    gen = torch.Generator().manual_seed(70)
    ids = torch.cat([torch.full((c,), e, dtype=torch.int32) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=gen)][:, None]
    routing = RoutingResult(weights=torch.rand(ids.shape[0], 1, generator=gen) + 0.1, ids=ids)
    weights = None
    if fmt is WeightFormat.MXFP4:
        from moekit.kernels.triton.kernel import TritonFusedKernel

        weights = TritonFusedKernel().prepare_weights(_weights(spec, gen), spec)
        assert weights.packing is WeightPacking.MXFP4_MMA_WORDS
    got, _ = _check_layer(spec, t=ids.shape[0], seed=71, routing=routing, config=TAIL, weights=weights)
    plain, _ = _check_layer(
        spec,
        t=ids.shape[0],
        seed=71,
        routing=routing,
        config=replace(TAIL, tail_block_m=None),
        weights=weights,
    )
    assert relative_l2_error(got, plain) <= TOLERANCE[dtype]


def test_tail_blocks_with_an_expert_map():
    spec = _spec(e=8, e_local=4, k=2, dtype=torch.float32)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    _check_layer(spec, t=45, expert_map=expert_map, seed=72, config=TAIL)


@pytest.mark.parametrize(
    ("max_chunks", "scan_tile", "pairwise_from"),
    [(256, 4096, 128), (3, 4096, 128), (256, 8, 128), (256, 4096, 16), (3, 4096, 16)],
    ids=["one-step-chunks", "multi-step-chunks", "one-expert-scans", "pairwise", "pairwise-multi-step"],
)
def test_align_methods_agree_bit_for_bit(max_chunks, scan_tile, pairwise_from, monkeypatch):
    """Out-of-range ids, an expert map and experts with zero pairs: every tensor identical. Capping the
    chunks at 3 makes each chunked program walk several one-hot steps, as at large P on a GPU; a scan
    tile of 8 gives each of 64 scan programs one expert's column; pairwise steps from 16 experts rank the
    40 local experts' pairs by comparing pairs (32 a step), as from E = 64 on a GPU."""

    monkeypatch.setattr(align, "_MAX_CHUNKS", max_chunks)
    monkeypatch.setattr(align, "_SCAN_TILE", scan_tile)
    monkeypatch.setattr(align, "_PAIRWISE_FROM_EXPERTS", pairwise_from)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(-2, 70, (250, 4), generator=gen, dtype=torch.int32)  # P = 1000, some dropped
    expert_map = torch.full((64,), -1, dtype=torch.int32)
    expert_map[torch.randperm(64, generator=gen)[:40]] = torch.arange(40, dtype=torch.int32)
    results = []
    for method in AlignMethod:
        with _poisoned_allocations():
            a = align_routing(ids, num_local_experts=40, block_m=16, expert_map=expert_map, method=method)
        results.append(a)
    first = results[0]
    for other in results[1:]:
        for name in ("sorted_pair_ids", "block_expert", "num_valid_blocks", "expert_offsets", "pair_expert"):
            assert torch.equal(getattr(first, name), getattr(other, name)), name
        assert torch.equal(first.expert_counts, other.expert_counts)


# ---------------------------------------------------------------------------------------------------------
# FP8 activation quantization: bit-exact with moekit.formats
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("quant", [ActivationQuant.FP8_PER_TOKEN, ActivationQuant.FP8_PER_GROUP_128])
@pytest.mark.parametrize("with_row_mult", [False, True])
@pytest.mark.parametrize(
    "cols", [200, 1100]
)  # per group: 2 groups in one program; 9 in two, the second ragged
def test_fp8_activation_quantization_is_bit_exact(quant, with_row_mult, cols):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, cols, generator=gen) * torch.logspace(-3, 3, 6).unsqueeze(1)  # ragged last group
    x[1] = 0.0  # amax 0: scale 1
    # Row 2: amax 448 -> scale 1, so these land exactly on E4M3 midpoints (ties go to even) or subnormals.
    ties = torch.tensor([448.0, 1.0625, 1.1875, 17.0, 19.0, 232.0, -1.0625, 0.00146484375, -0.0, 2.0**-10])
    x[2] = 0.5
    x[2, : ties.numel()] = ties
    mult = (torch.rand(6, generator=gen) + 0.5) if with_row_mult else None
    if mult is not None:
        mult[2] = 1.0
    data, scale = quantize_rows(x, quant=quant, row_mult=mult)
    ref = quantize_fp8_activation(x if mult is None else x * mult[:, None], quant=quant)
    assert torch.equal(scale, ref.scale)
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8))  # -0 included


@pytest.mark.parametrize(("t", "k", "e", "e_local"), [(1, 1, 4, 4), (13, 3, 8, 8), (40, 4, 8, 5)])
def test_sorted_quantization_puts_each_pair_in_its_row(t, k, e, e_local):
    # The WGMMA_FP8 engine's input: token t's per-group FP8 codes and scales in the sorted row of every
    # kept pair (t, k) (`pair_rows` inverts sorted_pair_ids), bit for bit the token-order quantization.
    gen = torch.Generator().manual_seed(t)
    cols = 384
    x = torch.randn(t, cols, generator=gen) * torch.logspace(-2, 2, t).unsqueeze(1)
    ids = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32)
    ids[0, 0] = e + 3  # out of range: dropped
    expert_map = None
    if e_local < e:
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[torch.randperm(e, generator=gen)[:e_local]] = torch.randperm(e_local, generator=gen).int()
    aligned = align_routing(ids, num_local_experts=e_local, block_m=16, expert_map=expert_map)
    rows = aligned.max_blocks * 16
    xq = torch.full((rows, cols), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN codes
    xs = torch.full((rows, cols // 128), math.nan)
    _jit_quant._quant_fp8_groups_sorted[(t, 1)](
        x,
        aligned.pair_expert,
        pair_rows(aligned),
        xq,
        xs,
        NUM_COLS=cols,
        stride_src=x.stride(0),
        stride_dst=xq.stride(0),
        stride_scale=xs.stride(0),
        TOP_K=k,
        GROUPS=4,
        PDL=False,  # interpreted: no programmatic dependent launch
    )
    expected = quantize_fp8_activation(x, quant=ActivationQuant.FP8_PER_GROUP_128)
    kept = 0
    for pair in range(t * k):
        if aligned.pair_expert[pair] < 0:
            continue
        kept += 1
        row = int(pair_rows(aligned)[pair])
        assert int(aligned.sorted_pair_ids[row]) == pair
        assert torch.equal(xq[row].view(torch.uint8), expected.data[pair // k].view(torch.uint8))
        assert torch.equal(xs[row], expected.scale[pair // k])
    assert kept == int((aligned.pair_expert >= 0).sum()) and kept < t * k  # the dropped pair


@pytest.mark.parametrize(("t", "k", "e"), [(1, 1, 4), (13, 3, 8)])
def test_per_token_quantization_of_pair_rows_only(t, k, e):
    # The W4A8 engine's h: per-token codes and scales of the sorted rows that hold a pair, bit-exact; the
    # padding rows and the rows past the valid blocks are neither read (NaN there) nor written.
    gen = torch.Generator().manual_seed(t)
    ids = torch.randint(0, e, (t, k), generator=gen, dtype=torch.int32)
    aligned = align_routing(ids, num_local_experts=e, block_m=16)
    rows, cols = aligned.max_blocks * 16, 200
    live = torch.zeros(rows, dtype=torch.bool)
    live[: int(aligned.num_valid_blocks) * 16] = True
    live &= aligned.sorted_pair_ids.long() < aligned.num_pairs
    src = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 2, rows).unsqueeze(1)
    src[~live] = math.nan
    codes = torch.full((rows, cols), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN codes
    scales = torch.full((rows, 1), math.nan)
    _jit_quant._quant_fp8_rows[(rows,)](
        src,
        None,
        codes,
        scales,
        NUM_COLS=cols,
        stride_src=src.stride(0),
        stride_dst=codes.stride(0),
        stride_scale=scales.stride(0),
        HAS_ROW_MULT=False,
        BLOCK=256,
        PDL=False,  # interpreted: no programmatic dependent launch
        sorted_pairs_ptr=aligned.sorted_pair_ids,
        num_pairs=aligned.num_pairs,
    )
    expected = quantize_fp8_activation(src[live], quant=ActivationQuant.FP8_PER_TOKEN)
    assert torch.equal(codes[live].view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(scales[live], expected.scale)
    assert bool((codes[~live].view(torch.uint8) == 0x7F).all()) and bool(scales[~live].isnan().all())
    assert int(live.sum()) == t * k and bool((~live).any())
    # The host entry point takes the alignment whole, for per-token scales only.
    data, scale = quantize_rows(src, quant=ActivationQuant.FP8_PER_TOKEN, pair_rows_of=aligned)
    assert torch.equal(data[live].view(torch.uint8), expected.data.view(torch.uint8))
    with pytest.raises(ValueError, match="per-token"):
        quantize_rows(src, quant=ActivationQuant.FP8_PER_GROUP_128, pair_rows_of=aligned)
    # With each row's max |value| known (the per-channel WGMMA_FP8 GEMM1 keeps it), one pass: the same
    # codes and scales, and the padding rows' maxima (NaN here) never read.
    row_amax = src.abs().amax(dim=1)
    one_pass, one_scale = quantize_rows(
        src, quant=ActivationQuant.FP8_PER_TOKEN, pair_rows_of=aligned, row_amax=row_amax
    )
    assert torch.equal(one_pass[live].view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(one_scale[live], expected.scale)
    with pytest.raises(ValueError, match="row_mult"):
        quantize_rows(src, quant=ActivationQuant.FP8_PER_TOKEN, row_mult=row_amax, row_amax=row_amax)


# ---------------------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------------------
ACTIVATIONS = [
    ActivationSpec(kind, alpha=1.702 if kind is Activation.SWIGLU_OAI else None, limit=limit)
    for kind in Activation
    for limit in (None, 0.75)
]  # 0.75 clamps a good share of values


@pytest.mark.parametrize("act", ACTIVATIONS, ids=lambda a: a.describe().replace(" ", "_"))
@pytest.mark.parametrize("layout", list(GateLayout), ids=lambda g: g.name)
@pytest.mark.parametrize(
    ("bias", "placement"),
    [
        (True, RouterWeightPlacement.OUTPUT),
        (False, RouterWeightPlacement.OUTPUT),
        (True, RouterWeightPlacement.INPUT),
    ],
    ids=["bias-output", "nobias-output", "bias-input"],
)
def test_every_activation_layout_bias_placement_fp32(act, layout, bias, placement):
    # fp32 weights and activations: the kernel's arithmetic is exact up to summation order, so a wrong
    # clamp, a swapped gate/up, a missing bias or a misplaced router weight shows far above 1e-5.
    k = 1 if placement is RouterWeightPlacement.INPUT else 3
    _check_layer(_spec(act=act, layout=layout, bias=bias, placement=placement, k=k), t=5)


FORMATS = [
    # (format, fp8 scale, activation quantization, activation dtype, why)
    (WeightFormat.FP16, None, ActivationQuant.NONE, torch.float16, "native fp16 dots"),
    (WeightFormat.BF16, None, ActivationQuant.NONE, torch.float32, "weights upcast to fp32 dots"),
    (WeightFormat.FP32, None, ActivationQuant.NONE, torch.float16, "activations upcast to fp32 dots"),
    (WeightFormat.MXFP4, None, ActivationQuant.NONE, torch.float32, "MXFP4 decode, exact compare"),
    (WeightFormat.MXFP4, None, ActivationQuant.NONE, torch.float16, "MXFP4 W4A16"),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_TENSOR, ActivationQuant.NONE, torch.float32, "W8A16 per tensor"),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_CHANNEL, ActivationQuant.NONE, torch.float16, "W8A16 per channel"),
    (WeightFormat.FP8_E4M3, Fp8Scale.BLOCK_128, ActivationQuant.NONE, torch.float32, "W8A16 blocks"),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_TENSOR, ActivationQuant.FP8_PER_TOKEN, torch.float32, "W8A8 token"),
    (WeightFormat.FP8_E4M3, Fp8Scale.PER_CHANNEL, ActivationQuant.FP8_PER_TOKEN, torch.float16, "W8A8 fp16"),
    (WeightFormat.FP8_E4M3, Fp8Scale.BLOCK_128, ActivationQuant.FP8_PER_TOKEN, torch.float32, "W8A8 mixed"),
    (
        WeightFormat.FP8_E4M3,
        Fp8Scale.BLOCK_128,
        ActivationQuant.FP8_PER_GROUP_128,
        torch.float32,
        "DeepSeek-V3 W8A8",
    ),
    (WeightFormat.MXFP4, None, ActivationQuant.FP8_PER_GROUP_128, torch.float16, "W4A8 groups fp16"),
]
# Per format: one row per layout, alternating activation/limit/bias/placement so that every format meets
# clamped and unclamped, biased and unbiased, INPUT and OUTPUT placement. H=144 / I=136 (ragged against
# 32, 64 and 128) in the second row.
FORMAT_VARIANTS = [
    dict(layout=GateLayout.CONCAT, act=ActivationSpec(Activation.SILU, limit=0.75), bias=False, k=2),
    dict(layout=GateLayout.INTERLEAVED, act=ActivationSpec.gpt_oss(), bias=True, h=144, i=136, k=3),
    dict(
        layout=GateLayout.INTERLEAVED,
        act=ActivationSpec(Activation.GELU_TANH),
        bias=True,
        k=1,
        placement=RouterWeightPlacement.INPUT,
    ),
]


@pytest.mark.parametrize(("fmt", "scale", "quant", "dtype", "why"), FORMATS, ids=[f[-1] for f in FORMATS])
@pytest.mark.parametrize("variant", range(len(FORMAT_VARIANTS)))
def test_every_format(fmt, scale, quant, dtype, why, variant):
    spec = _spec(fmt=fmt, scale=scale, quant=quant, dtype=dtype, **FORMAT_VARIANTS[variant])
    _check_layer(spec, t=5, seed=variant)


@pytest.mark.parametrize(("fmt", "scale", "quant", "dtype", "why"), FORMATS, ids=[f[-1] for f in FORMATS])
@pytest.mark.parametrize("variant", [0, 1])
def test_every_format_swap_ab(fmt, scale, quant, dtype, why, variant):
    spec = _spec(fmt=fmt, scale=scale, quant=quant, dtype=dtype, **FORMAT_VARIANTS[variant])
    _check_layer(spec, t=19, seed=10 + variant, config=TINY_SWAP)


@pytest.mark.parametrize(("fmt", "scale", "quant", "dtype", "why"), FORMATS, ids=[f[-1] for f in FORMATS])
@pytest.mark.parametrize("swap", [False, True], ids=["tokens-first", "swap-ab"])
def test_every_format_with_gemm2_on_its_own_tile(fmt, scale, quant, dtype, why, swap):
    """GEMM2 on a wider N tile than GEMM1 (H = 144: 64 + 64 + 16 rows, the last tile ragged)."""
    spec = _spec(fmt=fmt, scale=scale, quant=quant, dtype=dtype, **FORMAT_VARIANTS[1])
    base = TINY_SWAP if swap else TINY
    config = replace(base, gemm2_block_n=64)
    assert config.block_n_gemm2 == 64 and base.block_n_gemm2 == base.block_n
    _check_layer(spec, t=9, seed=21, config=config)


@pytest.mark.parametrize(
    "quant", [ActivationQuant.NONE, ActivationQuant.FP8_PER_GROUP_128], ids=["W8A16", "W8A8"]
)
@pytest.mark.parametrize(
    ("layout", "block_n", "gemm2_block_n", "swap"),
    [
        (GateLayout.CONCAT, 64, None, False),  # gate rows, then up rows: each half in one 128-row block
        (GateLayout.CONCAT, 128, 256, True),  # halves of whole blocks; GEMM2's last 256-row tile half empty
        (GateLayout.INTERLEAVED, 128, 256, False),  # 256 adjacent w13 rows: two blocks, one per half
    ],
    ids=["concat-64", "concat-128-swap-ab", "interleaved-128"],
)
def test_fp8_block_scales_as_one_or_two_numbers_a_k_step(quant, layout, block_n, gemm2_block_n, swap):
    """FP8 block-128 weights with tiles whose rows lie in one or two 128-row scale blocks (each K-step's
    weight scale then one or two numbers, `_expert_matmul`'s W_SCALE_BLOCKS): I = 256 and H = 384 put
    every tile's rows in several blocks in turn, each with its own random scale.

    W8A16 (no re-quantization) is compared at fp32's 1e-5. W8A8 re-quantizes GEMM1's output to E4M3,
    where fp32 sums in another order than the reference's can flip a code by 1/16 (interleaved-128 does:
    rel L2 5.3e-5 at every tile shape, and before these scale paths existed); it is held to the
    tolerance moekit gives FP8-activation specs, `tolerance(spec)`."""
    spec = _spec(
        fmt=WeightFormat.FP8_E4M3,
        scale=Fp8Scale.BLOCK_128,
        quant=quant,
        h=384,
        i=256,
        layout=layout,
        act=ActivationSpec(Activation.SILU),
        bias=False,
    )
    config = TritonMoEConfig(
        block_m=16,
        block_n=block_n,
        block_k=128,
        group_m=1,
        num_warps=4,
        num_stages=2,
        swap_ab=swap,
        gemm2_block_n=gemm2_block_n,
    )
    exact = quant is ActivationQuant.NONE
    _check_layer(spec, t=7, seed=70 + block_n, config=config, tol=None if exact else tolerance(spec))


@pytest.mark.parametrize("layout", list(GateLayout), ids=lambda g: g.name)
def test_gemm1_quantizing_h_itself_is_bitwise_the_separate_pass(layout, monkeypatch):
    """With per-1x128 activation quantization and GEMM1 tiles of one whole group (block_n 128, 128 | I),
    GEMM1's epilogue writes GEMM2's FP8 input itself: the layer must equal, bit for bit, the same tiles
    with h written in fp32 and quantized by the separate pass (same values, same arithmetic). A tail
    launch (tail_block_m) writes h from a second GEMM1 launch."""
    spec = _spec(
        fmt=WeightFormat.FP8_E4M3,
        scale=Fp8Scale.BLOCK_128,
        quant=ActivationQuant.FP8_PER_GROUP_128,
        h=128,
        i=256,
        layout=layout,
        act=ActivationSpec(Activation.SILU, limit=0.75),
        bias=layout is GateLayout.INTERLEAVED,
    )
    config = TritonMoEConfig(
        block_m=32, block_n=128, block_k=128, group_m=1, num_warps=4, num_stages=2, tail_block_m=16
    )
    assert launch.fuses_h_quantization(spec, config)
    assert not launch.fuses_h_quantization(spec, replace(config, block_n=64))
    assert not launch.fuses_h_quantization(spec, replace(config, split_k=2, tail_block_m=None))
    assert not launch.fuses_h_quantization(replace(spec, act_quant=ActivationQuant.FP8_PER_TOKEN), config)
    gen = torch.Generator().manual_seed(91)
    weights = _weights(spec, gen)
    x = torch.randn(60, spec.H, generator=gen)  # 120 pairs on 6 experts: full blocks and tail blocks
    routing = _routing(spec, 60, gen)
    with _poisoned_allocations():
        fused = triton_fused_moe(x, weights, routing, spec=spec, config=config)
    monkeypatch.setattr(launch, "fuses_h_quantization", lambda spec, config: False)
    with _poisoned_allocations():
        separate = triton_fused_moe(x, weights, routing, spec=spec, config=config)
    assert torch.equal(fused, separate)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    assert relative_l2_error(fused, expected) <= tolerance(spec)


W4A8_QUANTS = [ActivationQuant.FP8_PER_TOKEN, ActivationQuant.FP8_PER_GROUP_128]


@pytest.mark.parametrize("quant", W4A8_QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize(("block_k", "base"), [(64, TINY), (128, TINY_SWAP)], ids=["64", "128-swap-ab"])
def test_w4a8_folds_groups_into_wider_k_steps(quant, block_k, base):
    """W4A8 with 2 or 4 MX groups a K-step, each group's scale folded into its FP8 codes relative to the
    step's largest: exact (fp32) on weights whose neighbouring groups lie within 8 binades; per token and
    per 1x128 group; ragged H and I (144, 136), so steps straddle the end of each row."""
    spec = _spec(fmt=WeightFormat.MXFP4, quant=quant, dtype=torch.float32, **FORMAT_VARIANTS[1])
    _check_layer(spec, t=5, seed=50 + block_k, config=replace(base, block_k=block_k))


def test_w4a8_group_far_below_its_step_rounds_within_its_bound():
    """A group 10 binades below the largest of its 128-wide step leaves E4M3's exact range when folded
    (its codes times 2^-10): block_k 128 then rounds it, a change under 2^-9 of GEMM1's sums that can
    still move codes of the FP8 re-quantized intermediate, so the layer lands within W4A8's tolerance
    (the W8A8 rule, `tolerance(spec)`) but not exactly; block_k 32 (one group a step) stays exact."""
    spec = _spec(fmt=WeightFormat.MXFP4, quant=ActivationQuant.FP8_PER_TOKEN, h=128, i=64)
    gen = torch.Generator().manual_seed(61)
    weights = _weights(spec, gen)
    w13_scale = weights.w13_scale.clone()
    w13_scale[..., 1::4] -= 10  # the second group of every 128 columns of w13
    assert int(w13_scale.min()) > 0
    weights = replace(weights, w13_scale=w13_scale)
    x = torch.randn(6, spec.H, generator=gen)
    routing = _routing(spec, 6, gen)
    expected = fused_moe_reference(x, weights, routing, spec=spec)
    one_group = triton_fused_moe(x, weights, routing, spec=spec, config=TINY)
    folded = triton_fused_moe(x, weights, routing, spec=spec, config=replace(TINY, block_k=128))
    assert relative_l2_error(one_group, expected) <= TOLERANCE[torch.float32]
    assert 0 < relative_l2_error(folded, expected) <= tolerance(spec)


SPLITS = [
    # (split_k, format row of FORMATS, variant of FORMAT_VARIANTS, T, why)
    (2, 0, 0, 5, "fp16: H = 64 in two shares of 2 steps, I = 48 in 1 + 1 steps (the last ragged)"),
    (3, 3, 1, 9, "MXFP4 W4A16, H = 144: 5 steps in shares of 2, 2, 1; the slot past H adds zero"),
    (2, 11, 1, 4, "DeepSeek-V3 W8A8: block scales and 1x128 activation scales inside each share"),
    (4, 6, 2, 3, "W8A16 per channel, K = 1 with INPUT placement: finishing kernels apply the router weight"),
    (5, 1, 0, 2, "more shares than steps: shares past K are empty and add zero"),
]


@pytest.mark.parametrize(
    ("split", "fmt_row", "variant", "t", "why"), SPLITS, ids=[s[-1][:24] for s in SPLITS]
)
def test_split_k_matches_the_reference(split, fmt_row, variant, t, why):
    """split_k > 1: each GEMM sums its reduction in `split` shares (one program each) into fp32 partials,
    and `_moe_gemm1_splits` / `_moe_sum_k` add them in order and finish the epilogues."""
    fmt, scale, quant, dtype, _ = FORMATS[fmt_row]
    spec = _spec(fmt=fmt, scale=scale, quant=quant, dtype=dtype, **FORMAT_VARIANTS[variant])
    _check_layer(spec, t=t, seed=40 + split, config=replace(TINY, split_k=split))


def test_split_k_is_deterministic_and_close_to_one_share():
    spec = _spec(fmt=WeightFormat.FP16, dtype=torch.float16, **FORMAT_VARIANTS[1])
    one, expected = _check_layer(spec, t=6, seed=50)
    split, _ = _check_layer(spec, t=6, seed=50, config=replace(TINY, split_k=3))
    again, _ = _check_layer(spec, t=6, seed=50, config=replace(TINY, split_k=3))
    assert torch.equal(split, again)
    assert relative_l2_error(split, one) <= TOLERANCE[torch.float16]


def test_split_k_with_an_expert_map_drops_other_ranks():
    spec = _spec(e=8, e_local=4, k=2)
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    _check_layer(spec, t=11, expert_map=expert_map, seed=60, config=replace(TINY, split_k=2))


GPT_OSS_K2 = dict(layout=GateLayout.INTERLEAVED, act=ActivationSpec.gpt_oss(), bias=True, h=144, i=136)
ONE_BLOCK_PER_PAIR = [
    # (format row of FORMATS, spec variant, config, why)
    (0, FORMAT_VARIANTS[0], TINY, "fp16"),
    (4, GPT_OSS_K2, TINY, "MXFP4 W4A16, SwiGLU with clamp, interleaved rows, biases"),
    (11, FORMAT_VARIANTS[0], TINY, "DeepSeek-V3 W8A8: activations quantized per row of the unsorted pairs"),
    (
        4,
        GPT_OSS_K2,
        replace(TINY, split_k=2),
        "split-K: the finish kernels read each pair's expert from the ids",
    ),
    (0, FORMAT_VARIANTS[0], TINY_SWAP, "weights on the MMA's M side"),
]


@pytest.mark.parametrize(
    ("fmt_row", "variant", "config", "why"), ONE_BLOCK_PER_PAIR, ids=[c[-1][:24] for c in ONE_BLOCK_PER_PAIR]
)
@pytest.mark.parametrize("ids", [[5, 23], [7, 7]], ids=["two experts", "one expert twice"])
def test_decode_of_one_token_launches_no_alignment(fmt_row, variant, config, why, ids, monkeypatch):
    """One token: each of its K pairs is its own M-block (`align.one_block_per_pair`), no alignment runs.
    Routing given by hand may repeat an expert; the two blocks of that expert then both count."""

    def no_alignment(*args, **kwargs):
        raise AssertionError("align_routing ran for a decode step of one token")

    monkeypatch.setattr(align, "align_routing", no_alignment)
    fmt, scale, quant, dtype, _ = FORMATS[fmt_row]
    spec = _spec(fmt=fmt, scale=scale, quant=quant, dtype=dtype, e=24, **{**variant, "k": 2})
    routing = RoutingResult(weights=torch.tensor([[0.7, 0.4]]), ids=torch.tensor([ids], dtype=torch.int32))
    _check_layer(spec, t=1, seed=70 + fmt_row, config=config, routing=routing)


@pytest.mark.parametrize(
    ("fmt_row", "variant", "config", "why"), ONE_BLOCK_PER_PAIR, ids=[c[-1][:24] for c in ONE_BLOCK_PER_PAIR]
)
def test_sparse_pairs_launch_no_alignment_and_drop_ids_outside_the_experts(
    fmt_row, variant, config, why, monkeypatch
):
    """Three tokens on 96 experts (6 pairs, within 1/16 of them): one block a pair, no alignment. A shared
    expert is read by both its blocks; ids outside [0, E) (routing not checked, as under graph capture)
    are dropped as the alignment drops them, reading no weights past the last expert: they add zero."""

    def no_alignment(*args, **kwargs):
        raise AssertionError("align_routing ran for pairs sparse among the experts")

    monkeypatch.setattr(align, "align_routing", no_alignment)
    fmt, scale, quant, dtype, _ = FORMATS[fmt_row]
    spec = _spec(fmt=fmt, scale=scale, quant=quant, dtype=dtype, e=96, **{**variant, "k": 2})
    ids = torch.tensor([[5, 95], [95, 96 + 9], [-1, 30]], dtype=torch.int32)
    weights = torch.tensor([[0.7, 0.4], [0.2, 0.9], [0.5, 0.3]])
    dropped = (ids < 0) | (ids >= 96)
    gen = torch.Generator().manual_seed(71 + fmt_row)
    layer = _weights(spec, gen)
    x = torch.randn(3, spec.H, generator=gen).to(spec.act_dtype)
    # The reference takes in-range ids only: a dropped pair is the same pair on expert 0 with weight 0.
    expected = fused_moe_reference(
        x,
        layer,
        RoutingResult(weights=weights.masked_fill(dropped, 0.0), ids=ids.masked_fill(dropped, 0)),
        spec=spec,
    )
    out = torch.full((3, spec.H), math.nan, dtype=spec.act_dtype)
    with _poisoned_allocations():
        got = triton_fused_moe(
            x, layer, RoutingResult(weights=weights, ids=ids), spec=spec, config=config, out=out
        )
    assert torch.isfinite(got).all()
    assert relative_l2_error(got, expected) <= TOLERANCE[spec.act_dtype]


SHAPES = [
    # (T, K, E, H, I, why)
    (1, 1, 4, 32, 32, "decode: one token, K = 1 writes out directly"),
    (1, 4, 8, 64, 48, "decode: one token on four experts"),
    (17, 2, 4, 48, 200, "I ragged against every block size, more than one M-block per expert"),
    (9, 8, 8, 72, 64, "K = E: every expert hit"),  # H ragged against the 32-wide scale groups
]


@pytest.mark.parametrize(("t", "k", "e", "h", "i", "why"), SHAPES, ids=[s[-1].split(":")[0] for s in SHAPES])
@pytest.mark.parametrize("fmt", [WeightFormat.FP16, WeightFormat.MXFP4], ids=lambda f: f.name)
def test_shapes(t, k, e, h, i, why, fmt):
    act = ActivationSpec.gpt_oss() if fmt is WeightFormat.MXFP4 else ActivationSpec(Activation.SILU)
    layout = GateLayout.INTERLEAVED if fmt is WeightFormat.MXFP4 else GateLayout.CONCAT
    spec = _spec(fmt=fmt, dtype=torch.float16, e=e, k=k, h=h, i=i, act=act, layout=layout)
    _check_layer(spec, t=t, seed=t + k)


def test_zero_tokens_launch_nothing():
    spec = _spec(dtype=torch.float32)
    weights = _weights(spec, torch.Generator().manual_seed(0))
    routing = RoutingResult(weights=torch.empty(0, 2), ids=torch.empty(0, 2, dtype=torch.int32))
    out = triton_fused_moe(torch.empty(0, spec.H), weights, routing, spec=spec, config=TINY)
    assert out.shape == (0, spec.H) and out.dtype == torch.float32


@pytest.mark.parametrize("k", [1, 2])
def test_all_tokens_on_one_expert(k):
    # Two full M-blocks and a partial one for expert 2 (and expert 3 for k = 2); the others get nothing.
    spec = _spec(dtype=torch.float32, k=k, e=5)
    t = 40
    ids = torch.tensor([[2, 3][:k]] * t, dtype=torch.int32)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(1)) + 0.1
    _check_layer(spec, t=t, routing=RoutingResult(weights=w, ids=ids))


@pytest.mark.parametrize("k", [1, 3])
def test_expert_map_drops_other_ranks(k):
    # 8 global experts, 4 on this rank; about half of the pairs belong to other ranks and add zero.
    spec = _spec(
        dtype=torch.float32, e=8, e_local=4, k=k, layout=GateLayout.INTERLEAVED, act=ActivationSpec.gpt_oss()
    )
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    got, expected = _check_layer(spec, t=17, expert_map=expert_map, seed=k)
    assert expected.abs().sum() > 0


def test_mxfp4_ragged_tail_and_padding_bytes_are_never_data():
    # H = 200 and I = 72 leave 8 elements of padding in the last 32-group of every row. Fill that
    # padding with code 6.0 and put 0xFF (NaN) scale bytes and 0x77 blocks right after each row's
    # last group (the weights are views into wider buffers): none of it may reach the output.
    spec = _spec(
        fmt=WeightFormat.MXFP4,
        dtype=torch.float32,
        h=200,
        i=72,
        layout=GateLayout.INTERLEAVED,
        act=ActivationSpec.gpt_oss(),
        k=2,
    )
    clean = _weights(spec, torch.Generator().manual_seed(5))

    def dirty(blocks, scales, in_dim):
        e, n, g, _ = blocks.shape
        wide_b = torch.full((e, n, g + 1, 16), 0x77, dtype=torch.uint8)
        wide_s = torch.full((e, n, g + 1), 0xFF, dtype=torch.uint8)
        wide_b[:, :, :g] = blocks
        wide_s[:, :, :g] = scales
        tail = in_dim % 32
        wide_b[:, :, g - 1, tail // 2 :] = 0x77  # padded elements of the last group (tail is even here)
        return wide_b[:, :, :g], wide_s[:, :, :g]

    w13, s13 = dirty(clean.w13, clean.w13_scale, spec.H)
    w2, s2 = dirty(clean.w2, clean.w2_scale, spec.I)
    weights = replace(clean, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    # block_k = 64: the last K-tile of each row spans the real last group and the poisoned one after it.
    _check_layer(spec, t=5, weights=weights, config=replace(TINY, block_k=64))


DEFAULT_CONFIG_SPECS = [
    dict(fmt=WeightFormat.MXFP4, layout=GateLayout.INTERLEAVED, act=ActivationSpec.gpt_oss()),
    dict(fmt=WeightFormat.FP16),  # decode: weight rows on the MMA's M side (swap_ab)
    dict(fmt=WeightFormat.FP8_E4M3, scale=Fp8Scale.PER_CHANNEL, quant=ActivationQuant.FP8_PER_TOKEN),
]


@pytest.mark.parametrize("fields", DEFAULT_CONFIG_SPECS, ids=lambda f: f["fmt"].name)
def test_default_configs_run(fields):
    spec = _spec(dtype=torch.float16, **fields)
    for t in (1, 17):
        _check_layer(spec, t=t, config=default_config(spec, t))


def test_prefill_defaults_and_wide_gemm2_tiles_run():
    # Per-128 FP8 prefill (more than 32 pairs an expert): the default's 128-row blocks, its tail launches
    # and GEMM1 tiles on a ragged last scale group (I = 192); float 8-warp tiles with GEMM2 on 256 rows.
    fp8 = _spec(
        fmt=WeightFormat.FP8_E4M3,
        scale=Fp8Scale.BLOCK_128,
        quant=ActivationQuant.FP8_PER_GROUP_128,
        dtype=torch.float16,
        e=2,
        h=128,
        i=192,
    )
    config = default_config(fp8, 150)
    assert (config.block_m, config.num_warps, config.tail_block_m) == (128, 8, 64)
    _check_layer(fp8, t=150, config=config)  # about 150 pairs an expert: a full block and a tail
    fp16 = _spec(fmt=WeightFormat.FP16, dtype=torch.float16, e=4, h=256, i=96)
    wide = next(c for c in tuning_space(fp16, 90) if c.block_n_gemm2 == 256)
    _check_layer(fp16, t=90, config=wide)


# ---------------------------------------------------------------------------------------------------------
# configs and capabilities (no kernels)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        dict(block_m=8),
        dict(block_n=48),
        dict(block_k=0),
        dict(group_m=3),
        dict(num_warps=32),
        dict(num_stages=0),
        dict(block_m=True),
        dict(max_registers=100),  # not a multiple of 8
        dict(max_registers=16),
        dict(max_registers=256),
        dict(max_registers=True),
        dict(gemm2_block_n=48),
        dict(gemm2_block_n=8),
        dict(gemm2_block_n=512),
        dict(gemm2_block_n=True),
        dict(split_k=0),
        dict(split_k=17),
        dict(split_k=None),
        dict(split_k=2.0),
        dict(split_k=True),
        dict(block_m=32, tail_block_m=32),  # not block_m // 2
        dict(block_m=64, tail_block_m=16),
        dict(block_m=16, tail_block_m=8),  # under tl.dot's 16
        dict(block_m=32, tail_block_m=16, split_k=2),  # tail blocks with split-K: not both
        dict(block_m=32, tail_block_m=True),
    ],
)
def test_bad_configs_are_refused(bad):
    with pytest.raises(SpecError):
        TritonMoEConfig(**bad)


def test_configs_that_do_not_fit_the_spec_are_refused():
    mx = _spec(fmt=WeightFormat.MXFP4)
    assert TritonMoEConfig(block_k=16).reason_unusable(mx) is not None
    ds = _spec(fmt=WeightFormat.FP8_E4M3, scale=Fp8Scale.BLOCK_128, quant=ActivationQuant.FP8_PER_GROUP_128)
    assert TritonMoEConfig(block_k=256).reason_unusable(ds) is not None
    assert TritonMoEConfig(block_k=16).reason_unusable(ds) is not None
    with pytest.raises(SpecError, match="block_k"):
        x = torch.zeros(1, mx.H)
        gen = torch.Generator().manual_seed(0)
        bad = TritonMoEConfig(block_k=16)
        triton_fused_moe(x, _weights(mx, gen), _routing(mx, 1, gen), spec=mx, config=bad)


def test_the_word_path_refuses_more_than_four_warps():
    """8-warp tiles are not verified on the MXFP4 word path: intermittently wrong results on an H200
    without the K-step wgmma wait, slower and not race-hunted with it."""
    words = _spec(fmt=WeightFormat.MXFP4, dtype=torch.bfloat16, h=256, i=128)
    eight = TritonMoEConfig(block_m=64, block_n=128, block_k=64, num_warps=8)
    assert "num_warps=4" in eight.reason_unusable(words)
    assert TritonMoEConfig(num_warps=4).reason_unusable(words) is None
    no_words = _spec(fmt=WeightFormat.MXFP4, dtype=torch.float16, h=256, i=128)  # fp16: dot_scaled path
    assert eight.reason_unusable(no_words) is None
    assert eight.reason_unusable(_spec(fmt=WeightFormat.BF16, dtype=torch.bfloat16)) is None


def test_supports_and_default_configs():
    hopper = DeviceInfo(DeviceKind.CUDA, "NVIDIA H200", (9, 0))
    ampere = DeviceInfo(DeviceKind.CUDA, "NVIDIA A100", (8, 0))
    cpu = DeviceInfo(DeviceKind.CPU, "cpu")
    fmts = [(f, Fp8Scale.BLOCK_128 if f is WeightFormat.FP8_E4M3 else None) for f in WeightFormat]
    for (fmt, scale), act, layout in itertools.product(fmts, ACTIVATIONS, GateLayout):
        spec = _spec(fmt=fmt, scale=scale, act=act, layout=layout)
        assert triton_supports(spec) is None and triton_supports(spec, device=hopper) is None
        assert triton_supports(spec, device=cpu) is not None
        assert (triton_supports(spec, device=ampere) is None) == (not fmt.is_quantized)
        for t in (1, 8, 64, 4096):
            assert default_config(spec, t).reason_unusable(spec) is None


def test_mxfp4_scales_in_the_kernels_n_major_layout_read_the_same():
    """TritonFusedKernel.prepare_weights stores MXFP4 scales N-major; the kernel reads them by stride."""
    from moekit.kernels.triton.kernel import TritonFusedKernel

    spec = _spec(fmt=WeightFormat.MXFP4, dtype=torch.float16, h=72, i=64, layout=GateLayout.INTERLEAVED)
    weights = _weights(spec, torch.Generator().manual_seed(3))
    prepared = TritonFusedKernel().prepare_weights(weights, spec)
    assert prepared.w13_scale.stride(1) == 1 and prepared.w2_scale.stride(1) == 1
    assert torch.equal(prepared.w13_scale, weights.w13_scale) and prepared.w13 is weights.w13
    got_n_major, _ = _check_layer(spec, t=7, seed=3, weights=prepared)
    got_checkpoint, _ = _check_layer(spec, t=7, seed=3, weights=weights)
    assert torch.equal(got_n_major, got_checkpoint)


WORD_CONFIGS = [
    TINY,  # block_k 32: one scale group, two 16-column chunks a step
    TritonMoEConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=2),  # K % 64 != 0
    # A register cap is a compile option: the interpreter must take it and compute the same layer.
    TritonMoEConfig(block_m=16, block_n=32, block_k=64, num_stages=2, max_registers=96),
    # GEMM2 on its own N tile: 64 of H = 96 rows, the second tile half masked.
    TritonMoEConfig(block_m=16, block_n=32, block_k=64, num_stages=2, gemm2_block_n=64),
    # Split-K: H = 96 in 2 steps of 64, one a share; I = 48 in 1 step, the second share empty.
    TritonMoEConfig(block_m=16, block_n=32, block_k=64, num_stages=2, split_k=2),
]


@pytest.mark.parametrize("layout", list(GateLayout), ids=lambda g: g.name)
@pytest.mark.parametrize(
    "config", WORD_CONFIGS, ids=["bk32", "bk64", "bk64_regs96", "bk64_gemm2_n64", "bk64_split2"]
)
def test_mxfp4_mma_words_match_reference(layout, config):
    """prepare_weights turns MXFP4 into MXFP4_MMA_WORDS (fp32 activations here: the interpreter's bf16
    arithmetic is broken); the kernel's word decode and fragment reshapes must reproduce the layer."""
    from moekit.kernels.triton.kernel import TritonFusedKernel

    spec = _spec(fmt=WeightFormat.MXFP4, h=96, i=48, layout=layout, act=ActivationSpec.gpt_oss(), k=3)
    weights = _weights(spec, torch.Generator().manual_seed(11))
    prepared = TritonFusedKernel().prepare_weights(weights, spec)
    assert prepared.packing is WeightPacking.MXFP4_MMA_WORDS
    assert torch.equal(prepared.dequantize_w13(2), weights.dequantize_w13(2))
    _check_layer(spec, t=21, seed=11, weights=prepared, config=config)


def test_mxfp4_words_are_skipped_where_they_do_not_fit():
    from moekit.kernels.triton.kernel import TritonFusedKernel

    kernel = TritonFusedKernel()
    ragged = _spec(fmt=WeightFormat.MXFP4, h=200, i=48)  # H % 16 != 0
    fp16 = _spec(fmt=WeightFormat.MXFP4, h=96, i=48, dtype=torch.float16)  # fp16 operands
    for spec in (ragged, fp16):
        prepared = kernel.prepare_weights(_weights(spec, torch.Generator().manual_seed(1)), spec)
        assert prepared.packing is WeightPacking.CHECKPOINT
    spec = _spec(fmt=WeightFormat.MXFP4, h=96, i=48)
    weights = _weights(spec, torch.Generator().manual_seed(2))
    big = replace(weights, w2_scale=weights.w2_scale.clone().fill_(130))  # a block max above 12
    with pytest.warns(UserWarning, match="scale byte is 130"):
        assert kernel.prepare_weights(big, spec).packing is WeightPacking.CHECKPOINT


@pytest.mark.parametrize("layout", list(GateLayout), ids=lambda g: g.name)
def test_mxfp4_words_need_each_gate_up_half_in_whole_16_row_blocks(layout):
    """I = 40: 2I = 80 rows are whole 16-row blocks, but CONCAT's up half starts at row 40, inside a block,
    where a word tile would decode the neighbouring rows. The packing needs I (and H) multiples of 16, so
    these weights keep CHECKPOINT packing, and the layer still matches the reference."""
    from moekit.kernels.triton.kernel import TritonFusedKernel

    spec = _spec(fmt=WeightFormat.MXFP4, h=32, i=40, layout=layout, k=1, e=2)
    weights = _weights(spec, torch.Generator().manual_seed(12))
    prepared = TritonFusedKernel().prepare_weights(weights, spec)
    assert prepared.packing is WeightPacking.CHECKPOINT
    _, expected = _check_layer(spec, t=3, seed=13, weights=prepared, config=TINY)
    assert expected.abs().sum() > 0


@triton.jit
def _words_tile_probe(
    w_ptr, s_ptr, out_ptr, stride_wn, IN_DIM: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr
):
    rows = tl.arange(0, ROWS)
    groups: tl.constexpr = (IN_DIM + 31) // 32
    for k0 in range(0, IN_DIM, BK):
        kg = k0 // 32 + tl.arange(0, BK // 32)
        scales = tl.load(s_ptr + rows[:, None] * groups + kg[None, :])
        blocks = tl.arange(0, ROWS // 16)
        w = _jit_mxfp4._mxfp4_words_tile(
            w_ptr,
            blocks,
            blocks >= 0,
            scales,
            k0,
            IN_DIM,
            IN_DIM % BK == 0,
            stride_wn,
            False,
            tl.float32,
            ROWS,
            BK,
        )
        cols = k0 + tl.arange(0, BK)
        tl.store(out_ptr + rows[:, None] * IN_DIM + cols[None, :], w)


def test_mxfp4_words_decode_every_code_at_every_scale_it_accepts():
    """The word decode (fp32 variant) against `dequantize_mxfp4`, bit for bit: all 16 codes, in every
    fragment position, at every scale byte 0..128 the packing accepts (0.5 * 2^-127 included)."""
    from moekit.formats import dequantize_mxfp4
    from moekit.formats.mxfp4_words import pack_mma_words

    rows, in_dim = 128, 128
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (rows, in_dim // 32, 16), generator=gen, dtype=torch.uint8)
    scales = (torch.arange(rows * (in_dim // 32)) % 129).to(torch.uint8).reshape(rows, in_dim // 32)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1)
    assert codes.unique().numel() == 16 and scales.unique().numel() == 129
    words = pack_mma_words(blocks)
    out = torch.full((rows, in_dim), math.nan)
    for bk in (32, 64):
        _words_tile_probe[(1,)](words, scales, out, words.stride(0), in_dim, rows, bk)  # stride per block
        assert torch.equal(out, dequantize_mxfp4(blocks, scales, in_dim=in_dim)), f"block_k {bk}"

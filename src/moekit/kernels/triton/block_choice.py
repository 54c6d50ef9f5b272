"""Which block list a batch's GEMMs walk: one block a pair (`align.one_block_per_pair`, no launch) or
the alignment (`align.align_routing`). Data flow: (T, K, E_local, expert map, one expert's bytes) ->
`takes_one_block_per_pair` -> `align.gemm_blocks` builds that list. Host-side arithmetic only: no
tensor is read, so the choice never syncs and is the same under graph capture.
"""

from __future__ import annotations

# One block a pair or the alignment, by their extra costs. One block a pair streams an expert's weights
# once per pair: with P pairs routed uniformly over E local experts, about P - E(1 - (1 - 1/E)^P) of
# them repeat an expert, each reading that expert's bytes again at about the copy bandwidth. The
# alignment costs its launch and the aligned GEMMs' later start, a cost that grows with E. Fitted on an
# H200 (whole layer, graph replay, L2 flushed, both paths interleaved in one call): one block a pair
# ahead by 4 - 16 % for E 512 / K 10 at T = 2 - 8, Qwen3-30B (E 128, K 8) at T = 2 - 3, E 256 / K 8 /
# I 768 at T = 2 - 4 and gpt-oss-120b at T = 2 and 4; aligned ahead by 2 % for Qwen3-30B at T = 4 (3.6
# repeats expected, 8.5 us of bytes) and 13 % for DeepSeek-V3 at T = 4 (1.9 repeats of 44 MB); even for
# DeepSeek-V3 at T = 2. The one point the rule misses: gpt-oss-120b at T = 3, aligned 4 - 10 % ahead in
# two calls where half a repeat of 13 MB is expected (the draw repeated one: a whole MXFP4 decode).
_REPEAT_BYTES_PER_US = 4.0e6  # the H200's copy bandwidth, 4.0 - 4.2 TB/s measured
_ALIGNED_START_US = 4.0
_ALIGNED_START_US_PER_EXPERT = 0.012
# Whatever the bytes, never past a pair for every 4 local experts (vLLM's bound for the same choice;
# every measured win above sits under it): one block a pair launches a program per pair on 16-row tiles
# holding one row, so for small experts and many tokens the launch, not the repeats, would cost.
_MAX_PAIRS_PER_EXPERT = 1 / 4


def expected_repeats(*, num_pairs: int, num_local_experts: int) -> float:
    """Pairs, of `num_pairs` routed uniformly over `num_local_experts`, whose expert an earlier pair hit."""
    e = num_local_experts
    return num_pairs - e * (1.0 - (1.0 - 1.0 / e) ** num_pairs)


def takes_one_block_per_pair(
    *, num_tokens: int, top_k: int, num_local_experts: int, has_expert_map: bool, expert_bytes: int
) -> bool:
    """Whether `one_block_per_pair` serves a batch on local experts: one token (its K pairs go to K distinct
    experts, so each hit expert's weights are read once, as the alignment's blocks would), or pairs
    whose expected repeats of an expert (`expected_repeats`, each `expert_bytes` streamed again) cost
    less than the alignment, at most one pair for every 4 experts (see the constants above). With an
    expert map some pairs belong to other ranks, and one block a pair would need the map's lookup:
    aligned."""
    if has_expert_map or num_tokens <= 0:
        return False
    if num_tokens == 1:
        return True
    if num_tokens * top_k > _MAX_PAIRS_PER_EXPERT * num_local_experts:
        return False
    repeats = expected_repeats(num_pairs=num_tokens * top_k, num_local_experts=num_local_experts)
    aligned_us = _ALIGNED_START_US + _ALIGNED_START_US_PER_EXPERT * num_local_experts
    return repeats * expert_bytes / _REPEAT_BYTES_PER_US <= aligned_us

"""Hypothesis strategy for layer shapes that no preset and no tuned row covers: a base spec's math at a
drawn E x K x H x I (`moekit.presets.reshaped`), for the config-rule property tests."""

from hypothesis import strategies as st

from moekit.presets import reshaped


@st.composite
def reshaped_specs(draw, bases, experts, dims):
    """One of `bases` (MoESpecs) at E from `experts`, K in [1, min(8, E)], H and I from `dims`."""
    num_experts = draw(st.sampled_from(experts))
    top_k = draw(st.integers(1, min(8, num_experts)))
    base = draw(st.sampled_from(bases))
    dim = st.sampled_from(dims)
    return reshaped(base, f"{num_experts}x{top_k}x{draw(dim)}x{draw(dim)}")

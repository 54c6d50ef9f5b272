"""The Triton fused-MoE path as a registered kernel (CUDA; Hopper for FP8 and MXFP4).

Data flow: planner -> `supports` (`config.triton_supports`: capability data, sm_90 for FP8 and MXFP4)
-> config (`tuning.default_config` or a tuned row, checked by `TritonMoEConfig.reason_unusable`)
-> `prepare_weights` once at load (MXFP4 scales N-major, words where they fit) -> `run` hands the
typed launch to `launch.triton_fused_moe`. Importing this module needs Triton; the registry skips it
without.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from moekit.formats.mxfp4 import check_mxfp4_scales
from moekit.formats.mxfp4_w4a8 import MAX_EXACT_DROP, flushed_groups
from moekit.formats.mxfp4_words import pack_mma_words, scales_reason
from moekit.kernels.base import Kernel, KernelConfig, Launch, Problem
from moekit.kernels.triton.align import max_blocks_bound
from moekit.kernels.triton.config import (
    TRITON_CAPABILITIES,
    MatmulEngine,
    TritonMoEConfig,
    triton_supports,
    words_reason,
)
from moekit.kernels.triton.launch import share_counts, triton_fused_moe, workspace_bytes
from moekit.kernels.triton.tuning import default_config
from moekit.kernels.triton.tuning_space import tuning_space
from moekit.kernels.triton.wgmma_fp8 import wgmma_fp8_workspace_bytes
from moekit.kernels.triton.wgmma_w4a8 import pack_weights, wgmma_w4a8_reason, wgmma_w4a8_workspace_bytes
from moekit.kernels.triton.wgmma_words import wgmma_words_workspace_bytes
from moekit.spec import MoESpec, WeightFormat
from moekit.weights import ExpertWeights, WeightPacking


def n_major(scales: torch.Tensor) -> torch.Tensor:
    """`scales` [..., N, G] with the same values, laid out so that N is the fastest-moving index."""
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


def _w4a8_engine_takes(weights: ExpertWeights, spec: MoESpec) -> bool:
    """Whether `spec` runs the WGMMA_W4A8 engine on these weights: on an sm_90 GPU, where the engine
    computes the spec (W4A8 with per-token scales)."""
    on_hopper = weights.device.type == "cuda" and torch.cuda.get_device_capability(weights.device) == (9, 0)
    return on_hopper and wgmma_w4a8_reason(spec) is None


def _packed_for_w4a8(weights: ExpertWeights) -> ExpertWeights:
    """MXFP4_W4A8 packing, saying at load how many scale groups it flushes (`mxfp4_w4a8.pack_w4a8`)."""
    check_mxfp4_scales(weights.w13_scale, name="w13_scale")  # the packing keeps no E8M0 byte to check later
    check_mxfp4_scales(weights.w2_scale, name="w2_scale")
    flushed = flushed_groups(weights.w13_scale) + flushed_groups(weights.w2_scale)
    if flushed:
        total = weights.w13_scale.numel() + weights.w2_scale.numel()
        warnings.warn(
            f"W4A8 packing flushes {flushed} of {total} MXFP4 scale groups to zero: each sits more than "
            f"{MAX_EXACT_DROP} binades below the largest scale of its row's 256 columns, below what its "
            "E4M3 decode can hold (reference: ExpertWeights.unpacked() of the packed weights)",
            stacklevel=3,
        )
    return pack_weights(weights)


def _hopper(problem: Problem) -> bool:
    """Whether the problem's device is sm_90 (the Gluon engines' only target)."""
    return problem.device.compute_capability == (9, 0)


class TritonFusedKernel(Kernel):
    name = "triton_fused"
    priority = 100
    config_type = TritonMoEConfig
    capabilities = TRITON_CAPABILITIES

    def extra_check(self, spec: MoESpec, problem: Problem) -> str | None:
        return triton_supports(spec, device=problem.device)

    def default_config(self, spec: MoESpec, problem: Problem) -> TritonMoEConfig:
        return default_config(
            spec, problem.num_tokens, problem.device.multiprocessors, hopper=_hopper(problem)
        )

    def tuning_space(self, spec: MoESpec, problem: Problem) -> tuple[TritonMoEConfig, ...]:
        """`tuning_space.tuning_space`: the default plus a short list per regime of tokens per expert."""
        sms = problem.device.multiprocessors
        return tuning_space(spec, problem.num_tokens, sms, hopper=_hopper(problem))

    def prepare_weights(self, weights: ExpertWeights, spec: MoESpec) -> ExpertWeights:
        """MXFP4 only (other formats are read as they are), once at load time:

        - bf16 / fp32 activations, H and I multiples of 16, every scale byte <= 128: codes into
          MXFP4_MMA_WORDS (`moekit.formats.mxfp4_words`), decoded straight into the MMA's registers;
        - otherwise CHECKPOINT packing (decoded by `tl.dot_scaled` or bit operations).
        Either way the scales [E, N, G] are stored N-major (strides (G*N, 1, N)), so one K-step reads
        its BLOCK_N scale bytes as one run instead of BLOCK_N bytes G apart."""
        if weights.format is not WeightFormat.MXFP4 or weights.stores_floats:
            return weights
        if weights.packing in (WeightPacking.MXFP4_MMA_WORDS, WeightPacking.MXFP4_W4A8):
            return weights  # prepared already: no second scan of the scales
        if _w4a8_engine_takes(weights, spec):
            return _packed_for_w4a8(weights)

        scales = dict(w13_scale=n_major(weights.w13_scale), w2_scale=n_major(weights.w2_scale))
        if words_reason(spec) is not None:  # the spec rules it out: expected, nothing to say
            return dataclasses.replace(weights, **scales)
        data_reason = scales_reason(weights.w13_scale) or scales_reason(weights.w2_scale)
        if data_reason is not None:  # the data rules it out: say why this layer decodes more slowly
            warnings.warn(
                f"MXFP4 weights keep CHECKPOINT packing ({data_reason}): correct, but decoded by the "
                "slower tl.dot_scaled path instead of MXFP4_MMA_WORDS (plans of the WGMMA_WORDS engine "
                "run the tl.dot tiles MXFP4_PREFILL_TILES on them)",
                stacklevel=2,
            )
            return dataclasses.replace(weights, **scales)
        return dataclasses.replace(
            weights,
            packing=WeightPacking.MXFP4_MMA_WORDS,
            w13=pack_mma_words(weights.w13),
            w2=pack_mma_words(weights.w2),
            **scales,
        )

    def batch_invariant_config(self, config: KernelConfig, spec: MoESpec) -> KernelConfig | None:
        """Split-K and tail blocks off. Every program reduces a row over H (GEMM1) and I (GEMM2) in
        BLOCK_K steps in one order, a row's dot never reads another row, and the top-k sum adds a
        token's K rows in a fixed order; with one config for every T only split-K (shares chosen per T)
        and tail blocks (a second, smaller M tile for some rows) would make a row's arithmetic depend
        on the batch. None for the Gluon engines: WGMMA_FP8 always runs 64-row tails, and no engine's rows'
        bitwise independence of the batch is verified (the planner then takes the tl.dot default)."""
        if not isinstance(config, TritonMoEConfig) or config.engine is not MatmulEngine.TL_DOT:
            return None
        return dataclasses.replace(config, split_k=1, tail_block_m=None)

    def validate_config(self, config: KernelConfig, spec: MoESpec) -> str | None:
        return super().validate_config(config, spec) or config.reason_unusable(spec)

    def specialization_ints(self, spec: MoESpec, num_tokens: int, config: KernelConfig) -> tuple[int, ...]:
        """The pair count P = T*K and the M-block bound, plain int arguments of the Triton kernels."""
        pairs = num_tokens * spec.K
        blocks = max_blocks_bound(num_pairs=pairs, num_local_experts=spec.E_local, block_m=config.block_m)
        return pairs, blocks

    def workspace_bytes(self, spec: MoESpec, num_tokens: int, config: KernelConfig | None = None) -> int:
        if isinstance(config, TritonMoEConfig) and config.engine is MatmulEngine.WGMMA_FP8:
            return wgmma_fp8_workspace_bytes(spec, num_tokens)
        if isinstance(config, TritonMoEConfig) and config.engine is MatmulEngine.WGMMA_W4A8:
            return wgmma_w4a8_workspace_bytes(spec, num_tokens)
        if isinstance(config, TritonMoEConfig) and config.engine is MatmulEngine.WGMMA_WORDS:
            return wgmma_words_workspace_bytes(spec, num_tokens, config.block_m)
        shares = share_counts(spec, config) if isinstance(config, TritonMoEConfig) else None
        total = workspace_bytes(spec=spec, num_tokens=num_tokens, shares=shares)
        if isinstance(config, TritonMoEConfig) and config.engine is MatmulEngine.WGMMA_BF16:
            # h in the alignment's sorted rows: each expert's pairs padded to whole blocks
            rows = config.alignment_rows
            bound = rows * max_blocks_bound(
                num_pairs=num_tokens * spec.K, num_local_experts=spec.E_local, block_m=rows
            )
            total += (bound - num_tokens * spec.K) * spec.I * spec.act_dtype.itemsize
        return total

    def run(self, launch: Launch) -> torch.Tensor:
        return triton_fused_moe(
            launch.x,
            launch.weights,
            launch.routing,
            spec=launch.spec,
            config=launch.config,
            expert_map=launch.expert_map,
        )

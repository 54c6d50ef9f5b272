"""vLLM's per-channel FP8 MoE path (W8A8 with one scale per weight row and one per token), built from the
peer's block-FP8 pieces, for `bench_vs_vllm.py`'s "+fp8-channel" presets.

This is what vLLM runs for llm-compressor's "FP8-dynamic" checkpoints (compressed-tensors, channel weight
scales, dynamic per-token activation scales): `fused_moe_kernel` with `per_channel_quant=True` and no block
shape, the activations quantized per row (vLLM's `scaled_fp8_quant(use_per_token_if_dynamic=True)`:
scale = row amax / 448), and the tuned-config lookup for "fp8_w8a8" with no block size. The per-row
quantization here is the peer's Triton per-token-group kernel with the group as wide as the row: the same
numbers, a stand-in for vLLM's CUDA kernel as the peer's other quantization is.
"""

import torch


def channel_weights(peer, dims: dict, device: torch.device, seed: int):
    """Random weights (randn * 0.02, as the peer draws them) as FP8 E4M3 codes with one float32 scale per
    output row: w13 [E, 2I, H] with scale [E, 2I], w2 [E, H, I] with scale [E, H]."""
    fp8 = peer.ops.FP8_DTYPE
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    out = {}
    for name, (rows, cols) in (("w13", (2 * dims["I"], dims["H"])), ("w2", (dims["H"], dims["I"]))):
        codes = torch.empty((dims["E"], rows, cols), dtype=fp8, device=device)
        scale = torch.empty((dims["E"], rows), dtype=torch.float32, device=device)
        step = max(1, (1 << 30) // (rows * cols * 4))
        for e0 in range(0, dims["E"], step):
            e1 = min(dims["E"], e0 + step)
            w = torch.randn((e1 - e0, rows, cols), generator=g, device=device, dtype=torch.float32) * 0.02
            s = w.abs().amax(dim=-1).clamp_min(1e-12) / peer.ops.FP8_MAX
            codes[e0:e1] = (w / s[..., None]).clamp(peer.ops.FP8_MIN, peer.ops.FP8_MAX).to(fp8)
            scale[e0:e1] = s
            del w
        out[name], out[name + "_scale"] = codes, scale
    return out


def channel_experts(peer, weights: dict, dims: dict):
    """The peer's `VllmTritonExperts` switched to per-channel weight and per-token activation scales."""
    base = peer.VllmTritonExperts

    class ChannelExperts(base):
        def __init__(self):
            # The base class insists on a block shape for FP8; this path has none.
            super().__init__(
                weights["w13"],
                weights["w2"],
                activation=dims["act"],
                w1_scale=weights["w13_scale"],
                w2_scale=weights["w2_scale"],
                block_shape=[128, 128],
            )
            self.block_shape = None

        @staticmethod
        def _per_token(a):
            return peer.ops.per_token_group_quant_fp8(a, a.shape[-1])

        def quant_input(self, x):
            return self._per_token(x)

        def quant_mid(self, cache2):
            return self._per_token(cache2)

        def gemm1(self, a1q, a1s, cache1, assignment, config, top_k, compute_type):
            sorted_ids, expert_ids, ntpp = assignment
            peer.vfm.invoke_fused_moe_triton_kernel(
                a1q, self.w1, cache1, a1s, self.w1_scale, None, sorted_ids, expert_ids, ntpp, False, top_k,
                config, compute_type=compute_type, use_fp8_w8a8=True, use_int8_w8a8=False,
                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=True, block_shape=None,
                B_bias=None,
            )  # fmt: skip

        def gemm2(self, a2q, a2s, cache3, topk_weights, assignment, config, compute_type):
            sorted_ids, expert_ids, ntpp = assignment
            peer.vfm.invoke_fused_moe_triton_kernel(
                a2q, self.w2, cache3, a2s, self.w2_scale, topk_weights, sorted_ids, expert_ids, ntpp, True, 1,
                config, compute_type=compute_type, use_fp8_w8a8=True, use_int8_w8a8=False,
                use_int8_w8a16=False, use_int4_w4a16=False, per_channel_quant=True, block_shape=None,
                B_bias=None,
            )  # fmt: skip

    return ChannelExperts()

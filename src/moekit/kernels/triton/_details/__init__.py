"""Triton JIT code of the fused-MoE path; the host side that launches it is one level up.

Data flow: `codes` (the constexpr switch codes) -> `align` (pairs sorted by expert) -> `quant` (FP8
activations, W8A8) -> `gemm` (the two grouped GEMMs; K-loop in `matmul`, MXFP4 decode in `mxfp4`,
activation in `activation`) -> `reduce` (split-K finish and top-k sum). `route` is the routing
(softmax methods and DeepSeek-V3's grouped sigmoid).
"""

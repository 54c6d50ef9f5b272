"""Compile moekit's kernels for Hopper (sm_90) on any machine, no GPU needed: the tl.dot grouped GEMMs
(`_moe_gemm1` / `_moe_gemm2`) with the constexprs `launch.py` passes for a model's shape and math, the
Gluon engines' GEMMs as their launches specialize them, and any jit or Gluon function. `sass_report.py`
reads what the compiled kernels hold (spills, wgmma operands, the K-loops).
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moekit.kernels.triton._details import codes
from moekit.kernels.triton._details import gemm as _gemm_module
from moekit.kernels.triton.config import TritonMoEConfig
from moekit.kernels.triton.launch import fuses_h_quantization
from moekit.presets import preset

_W = {
    "words": (codes.WFMT_MXFP4_WORDS.value, "*i32"),
    "mxfp4": (codes.WFMT_MXFP4.value, "*u8"),
    "bf16": (codes.WFMT_FLOAT.value, "*bf16"),
    # FP8 activations, per 1x128 group: DeepSeek-V3's W8A8 (128x128 weight blocks) and W4A8
    "w8a8": (codes.WFMT_FP8.value, "*fp8e4nv"),
    "w4a8": (codes.WFMT_MXFP4.value, "*u8"),
}
_FP8_ACTIVATIONS = frozenset({"w8a8", "w4a8"})
_MXFP4 = frozenset({"words", "mxfp4", "w4a8"})
# The weight formats `compile_gemm` takes
FORMATS = tuple(sorted(_W))


def compile_gemm(
    gemm: int,
    fmt: str,
    block: tuple[int, int, int],
    warps: int,
    stages: int,
    split_k: int = 1,
    block_starts: bool = False,
    one_block_per_pair: bool = False,
    swap_ab: bool = False,
    model: str = "gpt-oss",
    max_registers: int | None = None,
):
    fn = _gemm_module._moe_gemm1 if gemm == 1 else _gemm_module._moe_gemm2
    w_format, w_type = _W[fmt]
    a_name, a_scale, out_name = (
        ("x_ptr", "x_scale_ptr", "h_ptr") if gemm == 1 else ("h_ptr", "h_scale_ptr", "y_ptr")
    )
    fp8_acts = fmt in _FP8_ACTIVATIONS
    pointers = {
        a_name: "*fp8e4nv" if fp8_acts else "*bf16",
        a_scale: "*fp32" if fp8_acts else "constexpr",
        "w_ptr": w_type,
        "b_ptr": "*bf16",
        # One block a pair (a decode step of few pairs): no sorted pair list, no device block count.
        "sorted_pairs_ptr": "constexpr" if one_block_per_pair else "*i32",
        "block_expert_ptr": "*i32",
        "block_start_ptr": "*i32" if block_starts else "constexpr",  # tail-block launches (a start list)
        "num_blocks_ptr": "constexpr" if one_block_per_pair else "*i32",
        out_name: "*fp32" if fp8_acts and gemm == 1 else "*bf16",  # h is fp32 before its FP8 quantization
        "w_scale_ptr": {"bf16": "constexpr", "w8a8": "*fp32"}.get(fmt, "*u8"),
        "route_w_ptr": "*fp32" if gemm == 2 else "constexpr",
        "part_ptr": "*fp32" if split_k > 1 else "constexpr",
    }
    if gemm == 1:
        pointers["h_scale_ptr"] = "constexpr"  # GEMM1 quantizes h itself only with QUANT_H (below)
    values = dict(
        HIDDEN=2880,
        INTER_SIZE=2880,
        W_FORMAT=w_format,
        FP8_SCALE=codes.FP8S_BLOCK.value if fmt == "w8a8" else 0,
        A_QUANT=codes.AQ_GROUP.value if fp8_acts else 0,
        DOT_FP32=False,
        MX_NATIVE=fmt in ("words", "mxfp4"),
        SWAP_AB=swap_ab,
        HAS_BIAS=True,
        BLOCK_M=block[0],
        BLOCK_N=block[1],
        BLOCK_K=block[2],
        GROUP_M=1,
        SPLIT_K=split_k,
        PDL=True,  # as launched on Hopper (`moekit.kernels.triton.pdl.pdl_args`)
    )
    if gemm == 1:
        values.update(TOP_K=4, INTERLEAVED=True, ROUTE_ON_INPUT=False, ACTIVATION=3, ALPHA=1.702)
        values.update(HAS_LIMIT=True, LIMIT=7.0, QUANT_H=False, H_SORTED=False)
    else:
        values.update(ROUTE_ON_OUTPUT=True)
    if model == "deepseek":  # DeepSeek-V3's layer: CONCAT gate/up rows, SiLU, no biases, K = 8
        values.update(HIDDEN=7168, INTER_SIZE=2048, HAS_BIAS=False)
        if gemm == 1:
            values.update(TOP_K=8, INTERLEAVED=False, ACTIVATION=codes.ACT_SILU.value, ALPHA=None)
            values.update(HAS_LIMIT=False, LIMIT=None)
            tile = TritonMoEConfig(block_m=block[0], block_n=block[1], block_k=block[2], split_k=split_k)
            if fp8_acts and fuses_h_quantization(preset("deepseek-v3"), tile):  # GEMM1 quantizes h itself
                values.update(QUANT_H=True)
                pointers.update(h_ptr="*fp8e4nv", h_scale_ptr="*fp32")
    if fmt in _MXFP4:
        values["stride_wsn"] = 1  # N-major scales, as prepare_weights stores them
    return compile_for_hopper(
        fn,
        values=values,
        pointers=pointers,
        warps=warps,
        stages=stages,
        max_registers=max_registers,
        unaligned=("num_pairs", "num_pid_m"),
    )


def compile_for_hopper(
    fn,
    *,
    values: dict,
    pointers: dict[str, str],
    warps: int,
    stages: int,
    max_registers: int | None = None,
    floats: tuple[str, ...] = (),
    unaligned: tuple[str, ...] = (),
):
    """`triton.compile` of jit function `fn` for sm_90: `values` are its constexprs, `pointers` its
    pointer types ("constexpr" for an absent one), `floats` its fp32 scalars, every other argument an
    i32. Pointers and ints other than `unaligned` are specialized as multiples of 16, as gpt-oss's
    launches are."""
    signature, constants = {}, {}
    for name in fn.arg_names:
        if name in values:
            signature[name], constants[name] = "constexpr", values[name]
        elif name in pointers:
            signature[name] = pointers[name]
            if pointers[name] == "constexpr":
                constants[name] = None
        else:
            signature[name] = "fp32" if name in floats else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name] not in ("constexpr", "fp32") and name not in unaligned
    }
    index = {name: i for i, name in enumerate(fn.arg_names)}
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(index[k],): v for k, v in constants.items()}, attrs=attrs
    )
    options = dict(num_warps=warps, num_stages=stages)
    if max_registers is not None:
        options["maxnreg"] = max_registers
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_wgmma_fp8_for_hopper(
    gemm: int,
    *,
    stages: int | None = None,
    hidden=7168,
    inter=2048,
    gemm1_rows: int = 64,
    per_channel: bool = False,
):
    """The WGMMA_FP8 engine's Gluon GEMM (`gemm` 1 on 64-row blocks, or on 128 with `gemm1_rows`=128;
    2 on 128) compiled for sm_90 at a layer's H and I, with the launcher's register budgets, at ring
    depth `stages` (None: the deepest GEMM1's config takes, GEMM2's fixed depth); `per_channel`: the
    per-channel form (GEMM1 on 128 rows only)."""
    from triton.experimental.gluon import language as gl

    from moekit.kernels.triton import wgmma_fp8 as host
    from moekit.kernels.triton._details import (
        codes,
        wgmma_fp8_channel,
        wgmma_fp8_gemm1,
        wgmma_fp8_gemm1_tall,
        wgmma_fp8_gemm2,
    )
    from moekit.kernels.triton.config import WGMMA_FP8_GEMM1_STAGES

    def descriptor(block: list[int]) -> str:
        return _descriptor_type(block, gl.float8e4nv, "fp8e4nv")

    weight = descriptor([host.TILE_N, host.TILE_K])
    if stages is None:  # as the launch runs it: GEMM1's deepest ring (the default configs'), GEMM2's own
        gemm1_deepest = WGMMA_FP8_GEMM1_STAGES[None if gemm1_rows == host.GEMM1_ROWS else gemm1_rows][-1]
        stages = gemm1_deepest if gemm == 1 else host.GEMM2_STAGES
    constants = dict(
        HIDDEN=hidden,
        INTER_SIZE=inter,
        GROUP_M=8,
        NUM_STAGES=stages,
        MATH_REGISTERS=host.MATH_REGISTERS,
        LOAD_REGISTERS=host.LOAD_REGISTERS,
    )
    blocks = dict(block_expert_ptr="*i32", num_blocks_ptr="*i32")  # every kernel's block list
    paired = dict(blocks, block_start_ptr="*i32", expert_end_ptr="*i64")  # `paired_blocks`' 128-row blocks
    if gemm == 1 and per_channel:
        if gemm1_rows != host.CHANNEL_GEMM1_ROWS:
            raise ValueError(
                f"the per-channel GEMM1 runs on {host.CHANNEL_GEMM1_ROWS} rows, got {gemm1_rows}"
            )
        fn = wgmma_fp8_channel._fp8_channel_gemm1
        pointers = dict(
            x_desc=descriptor([gemm1_rows, host.TILE_K]),
            w_desc=descriptor([host.CHANNEL_GEMM1_COLUMNS, host.TILE_K]),
            x_scale_ptr="*fp32",
            w_scale_ptr="*fp32",
            h_desc=_descriptor_type([host.GEMM1_ROWS, host.CHANNEL_GEMM1_COLUMNS], gl.float32, "fp32"),
            row_amax_ptr="*fp32",
            **paired,
        )
        constants.update(ACTIVATION=codes.ACT_SILU.value, ALPHA=0.0, HAS_LIMIT=False, LIMIT=0.0)
    elif gemm == 1:
        tall = gemm1_rows == 2 * host.GEMM1_ROWS
        fn = wgmma_fp8_gemm1_tall._fp8_gemm1_tall if tall else wgmma_fp8_gemm1._fp8_gemm1
        pointers = dict(
            x_desc=descriptor([gemm1_rows, host.TILE_K]),
            w_desc=descriptor([host.TILE_N // 2, host.TILE_K]) if tall else weight,
            x_scale_ptr="*fp32",
            w_scale_ptr="*fp32",
            h_ptr="*fp8e4nv",
            h_scale_ptr="*fp32",
            **(paired if tall else blocks),
        )
        constants.update(ACTIVATION=codes.ACT_SILU.value, ALPHA=0.0, HAS_LIMIT=False, LIMIT=0.0)
    else:
        fn = wgmma_fp8_gemm2._fp8_gemm2
        pointers = dict(
            h_desc=descriptor([2 * host.GEMM1_ROWS, host.TILE_K]),
            w_desc=weight,
            h_scale_ptr="*fp32",
            w_scale_ptr="*fp32",
            sorted_pairs_ptr="*i32",
            route_w_ptr="*fp32",
            y_ptr="*bf16",
            **paired,
        )
        constants.update(PER_CHANNEL=per_channel)
    return compile_gluon_for_hopper(fn, pointers=pointers, constants=constants, warps=4)


def compile_wgmma_bf16_for_hopper(
    *, block_n: int = 256, hidden=2048, inter=768, paired: bool = False, bias: bool = False
):
    """The WGMMA_BF16 engine's Gluon GEMM2 compiled for sm_90 at a layer's H and I (Qwen3-30B's by
    default), as `wgmma_bf16_gemm2` launches it: `block_n` columns of y a tile, over `paired_blocks`'
    start list or the alignment's own 128-row blocks, with or without b2."""
    from triton.experimental.gluon import language as gl

    from moekit.kernels.triton import wgmma_bf16 as host
    from moekit.kernels.triton._details import wgmma_bf16_gemm2

    def descriptor(rows: int) -> str:
        return _descriptor_type([rows, host.TILE_K], gl.bfloat16, "bf16")

    constants = dict(
        HIDDEN=hidden,
        INTER_SIZE=inter,
        GROUP_M=8,
        NUM_STAGES=host._GEMM2_STAGES[block_n],
        HAS_BIAS=bias,
        ROUTE_ON_OUTPUT=True,
        MATH_REGISTERS=host.MATH_REGISTERS,
        LOAD_REGISTERS=host.LOAD_REGISTERS,
    )
    pointers = dict(
        h_desc=descriptor(host.GEMM2_ROWS),
        w_desc=descriptor(block_n),
        sorted_pairs_ptr="*i32",
        route_w_ptr="*fp32",
        y_ptr="*bf16",
        block_expert_ptr="*i32",
        num_blocks_ptr="*i32",
        expert_end_ptr="*i64",
    )
    # y's address and row stride are multiples of 16, as the JIT specializes them at run time
    return _compile_bf16_engine(
        wgmma_bf16_gemm2._bf16_gemm2, pointers, constants, paired, bias, aligned=("y_ptr", "stride_ym")
    )


def _compile_bf16_engine(fn, pointers: dict, constants: dict, paired: bool, bias: bool, aligned: tuple):
    """A WGMMA_BF16 GEMM with or without b13 / b2 and a block start list (else None constexprs)."""
    pointers = {**pointers, **({"b_ptr": "*bf16"} if bias else {})}
    pointers.update({"block_start_ptr": "*i32"} if paired else {})
    constants = {
        **constants,
        **({} if bias else {"b_ptr": None}),
        **({} if paired else {"block_start_ptr": None}),
    }
    return compile_gluon_for_hopper(fn, pointers=pointers, constants=constants, warps=4, aligned=aligned)


def compile_wgmma_bf16_gemm1_for_hopper(
    *,
    block_n: int = 128,
    hidden=2048,
    inter=768,
    stages: int | None = None,
    paired: bool = False,
    bias: bool = False,
    interleaved: bool = False,
):
    """The WGMMA_BF16 engine's Gluon GEMM1 compiled for sm_90 at a layer's H and I (Qwen3-30B's by
    default, SiLU, K = 8), `block_n` columns of h a tile, as `wgmma_bf16_gemm1` launches it; `interleaved`:
    gate/up rows interleaved (gate and up through their own descriptors); `stages` None: the launch's."""
    from triton.experimental.gluon import language as gl

    from moekit.kernels.triton import wgmma_bf16 as host
    from moekit.kernels.triton._details import codes, wgmma_bf16_gemm1

    weight = _descriptor_type([block_n, host.TILE_K], gl.bfloat16, "bf16")
    constants = dict(
        HIDDEN=hidden,
        INTER_SIZE=inter,
        TOP_K=8,
        GROUP_M=8,
        NUM_STAGES=host.GEMM1_STAGES if stages is None else stages,
        HAS_BIAS=bias,
        ROUTE_ON_INPUT=False,
        ACTIVATION=codes.ACT_SILU.value,
        ALPHA=0.0,
        HAS_LIMIT=False,
        LIMIT=0.0,
        INTERLEAVED=interleaved,
        MATH_REGISTERS=host.GEMM1_MATH_REGISTERS,
        LOAD_REGISTERS=host.GEMM1_LOAD_REGISTERS,
        route_w_ptr=None,
    )
    pointers = dict(
        x_ptr="*bf16",
        gate_desc=weight,
        up_desc=weight,
        h_ptr="*bf16",
        sorted_pairs_ptr="*i32",
        block_expert_ptr="*i32",
        num_blocks_ptr="*i32",
        expert_end_ptr="*i64",
    )
    # x's and h's addresses and row strides are multiples of 16 (the JIT specializes them so; cp.async
    # needs it for x)
    aligned = ("x_ptr", "stride_xm", "h_ptr", "stride_hm")
    return _compile_bf16_engine(
        wgmma_bf16_gemm1._bf16_gemm1, pointers, constants, paired, bias, aligned=aligned
    )


def compile_wgmma_words_for_hopper(
    gemm: int,
    *,
    block_m: int = 128,
    stages: int = 4,
    hidden=2880,
    inter=2880,
    interleaved: bool = True,
    half_wide: bool = False,
):
    """The WGMMA_WORDS engine's Gluon GEMM (`gemm` 1 or 2) compiled for sm_90 at a layer's H and I with
    gpt-oss's math (SwiGLU with its limit, biases; gate/up rows interleaved or, with `interleaved`
    False, concatenated), as `wgmma_words_moe` launches it (its register cap); `half_wide`: the kernels
    with a second, half-wide tile for blocks at most half full (two K-loops)."""
    from moekit.kernels.triton import wgmma_words as host
    from moekit.kernels.triton._details import codes, wgmma_words

    pointers = dict(w_ptr="*i32", s_ptr="*u8", b_ptr="*bf16", sorted_pairs_ptr="*i32")
    pointers |= dict(block_expert_ptr="*i32", num_blocks_ptr="*i32", h_ptr="*bf16")
    constants = dict(
        HIDDEN=hidden, INTER_SIZE=inter, BLOCK_M=block_m, STAGES=stages, GROUP_M=8, HALF_WIDE=half_wide
    )
    if gemm == 1:
        fn, strides = wgmma_words._gemm1, ("stride_xm", "stride_hm")
        pointers["x_ptr"] = "*bf16"
        act = dict(ACTIVATION=codes.ACT_SWIGLU_OAI.value, ALPHA=1.702, HAS_LIMIT=True, LIMIT=7.0)
        constants |= dict(TOP_K=4, INTERLEAVED=interleaved, **act)
    else:
        fn, strides = wgmma_words._gemm2, ("stride_hm", "stride_ym")
        pointers |= dict(route_w_ptr="*fp32", y_ptr="*bf16")
    return compile_gluon_for_hopper(
        fn,
        pointers=pointers,
        constants=constants,
        warps=host.NUM_WARPS,
        maxnreg=host.register_cap(block_m),
        aligned=(*pointers, *strides),
    )


def compile_words_decode_for_hopper(
    gemm: int, *, n_tile: int = 8, split_k: int = 2, depth: int = 3, hidden=2880, inter=2880
):
    """The MMA_WORDS_DECODE engine's Gluon GEMM compiled for sm_90 as `words_decode.decode_gemm` launches it
    for GEMM `gemm` (1: K = H, N = 2I; 2: K = I, N = H) of a layer, `n_tile` pairs an MMA (8: one pair a
    block), with its register cap."""
    from moekit.kernels.triton import words_decode as host
    from moekit.kernels.triton._details import words_decode

    in_dim, n_rows = (hidden, 2 * inter) if gemm == 1 else (inter, hidden)
    pointers = dict(
        a_ptr="*bf16", w_ptr="*i32", s_ptr="*u8", sorted_pairs_ptr="*i32", block_expert_ptr="*i32"
    )
    pointers |= dict(block_start_ptr="*i32", num_blocks_ptr="*i32", part_ptr="*fp32")
    constants = dict(
        IN_DIM=in_dim,
        N_ROWS=n_rows,
        A_ROW_DIV=4 if gemm == 1 else 1,
        BLOCK_M=16,
        N_TILE=n_tile,
        SPLIT_K=split_k,
    )
    return compile_gluon_for_hopper(
        words_decode._decode_gemm,
        pointers=pointers,
        constants=constants | dict(DEPTH=depth),
        warps=host.NUM_WARPS,
        maxnreg=host.register_cap(n_tile, depth),
        aligned=("a_ptr", "w_ptr", "s_ptr", "part_ptr", "stride_am", "stride_part_split", "stride_part_m"),
    )


def _descriptor_type(block: list[int], gl_dtype, name: str) -> str:
    """The signature type of a TMA descriptor argument: `name` elements in `block` boxes, the default NVMMA
    shared layout the launches build their descriptors with."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(block, gl_dtype)
    return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"


def compile_gluon_for_hopper(
    fn,
    *,
    pointers: dict,
    constants: dict,
    warps: int,
    maxnreg: int | None = None,
    aligned: tuple[str, ...] = (),
):
    """`triton.compile` of Gluon function `fn` for sm_90: `constants` are its constexprs, `pointers` its
    pointer (or descriptor) types, every other argument an i32; `aligned` arguments are specialized as
    multiples of 16."""
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names
    }
    index = {name: i for i, name in enumerate(fn.arg_names)}
    attrs = {(index[name],): [["tt.divisibility", 16]] for name in aligned}
    options = {"num_warps": warps} | ({} if maxnreg is None else {"maxnreg": maxnreg})
    return triton.compile(
        GluonASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32), options=options
    )


def compile_wgmma_w4a8_for_hopper(
    gemm: int,
    *,
    hidden: int,
    inter: int,
    stages: int = 4,
    bias: bool = True,
    decode_under_mma: bool = True,
):
    """The WGMMA_W4A8 engine's GEMM (`_details.wgmma_w4a8._w4a8_gemm`) as `wgmma_w4a8_moe` launches it for
    GEMM 1 (gated, GPT-OSS's SwiGLU with its limit, gate/up interleaved) or 2 of a layer of `hidden` x
    `inter` (`decode_under_mma`: what the host's `wgmma_w4a8.decode_under_mma` gives)."""
    from triton.experimental.gluon import language as gl

    from moekit.formats import mxfp4_w4a8
    from moekit.kernels.triton._details.wgmma_w4a8 import _w4a8_gemm
    from moekit.kernels.triton.wgmma_w4a8 import BLOCK_M, LOAD_REGISTERS, MATH_REGISTERS

    gated = gemm == 1
    pointers = dict(
        a_desc=_descriptor_type([BLOCK_M, mxfp4_w4a8.STEP_K], gl.float8e4nv, "fp8e4nv"),
        a_scale_ptr="*fp32",
        w_ptr="*i32",
        d_ptr="*i32",
        b_ptr="*bf16",
        route_w_ptr="*fp32",
        sorted_pairs_ptr="*i32",
        block_expert_ptr="*i32",
        num_blocks_ptr="*i32",
        out_ptr="*fp32" if gated else "*bf16",
    )
    n_out = 2 * inter if gated else hidden
    constants = dict(
        KT=mxfp4_w4a8.steps(hidden if gated else inter),
        N_ROWS=mxfp4_w4a8.padded_rows(n_out),
        N_OUT=n_out,
        BN=BLOCK_M,
        NS=stages,
        GROUP_M=1,
        GATED=gated,
        INTERLEAVED=True,
        ACTIVATION=codes.ACT_SWIGLU_OAI.value,
        ALPHA=1.702,
        HAS_LIMIT=True,
        LIMIT=7.0,
        MATH_REGISTERS=MATH_REGISTERS,
        LOAD_REGISTERS=LOAD_REGISTERS,
        NARROW=True,
        DECODE_UNDER_MMA=decode_under_mma,
    )
    if not bias:
        constants["b_ptr"] = None
    aligned = ("a_scale_ptr", "w_ptr", "d_ptr", "out_ptr", "stride_d", "stride_out")
    return compile_gluon_for_hopper(
        _w4a8_gemm, pointers=pointers, constants=constants, warps=4, aligned=aligned
    )

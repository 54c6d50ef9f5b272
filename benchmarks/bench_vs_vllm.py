#!/usr/bin/env python3
"""moekit and vLLM's Triton fused-MoE expert path side by side: same weights, inputs and top-k routing.

Usage (GPU; the peer fetched with `shared/peers/vllm/get-vllm-fused-moe peers/vllm`):
  python benchmarks/bench_vs_vllm.py --vllm peers/vllm --presets qwen3-30b-a3b,deepseek-v3 \
      --tokens 1,64,1024 --json bench-results/vs-vllm.json
  python benchmarks/bench_vs_vllm.py --vllm peers/vllm --dry-run     # CPU: tiny shapes, interpreted

What each side times, from the same top-k ids and weights (neither side's router): moekit's `fused_moe`
(routing preparation, both GEMMs with the activation, the top-k sum) and vLLM's `VllmTritonExperts.forward`
(align, [FP8 input quantization], GEMM1, activation, [FP8 quantization], GEMM2, moe_sum), each captured in
a CUDA graph and replayed with L2 flushed before every call (`moekit.app.bench.flushed_seconds`, the
same timer for both). The weights are vLLM's `Weights` tensors, handed to moekit as they are (the two
libraries store w13 [E, 2I, H], w2 [E, H, I] and 128x128 FP8 block scales alike), so both multiply the
very same numbers. Both outputs are checked against moekit's fp32 reference before timing (output
poisoned with NaN first), at moekit's tolerance for the spec.

Presets: vLLM's names. `gpt-oss-120b` is BF16 on the vLLM side (its MXFP4 path is triton_kernels,
`peers/bench_triton_kernels.py`), so moekit runs it in BF16 too. `name@ExKxHxI` runs a preset's math at
another shape (vLLM then looks up its tuned configs for that E and N, or its defaults). A "+fp8-channel"
suffix (e.g. `qwen3-30b-a3b+fp8-channel`) runs the preset with FP8 weights scaled per output row and FP8
activations scaled per token on both sides, as llm-compressor's "FP8-dynamic" checkpoints are served
(`vllm_channel.py` builds vLLM's side).
"""

import argparse
import importlib.util
import json
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch

VLLM_PRESETS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b")


def _load_peer(path: Path):
    """vLLM's standalone benchmark module (its Weights, make_moe, make_inputs, PRESETS, TINY)."""
    script = path / "bench_vllm.py"
    if not script.is_file():
        sys.exit(f"{script} not found: run shared/peers/vllm/get-vllm-fused-moe {path} first")
    spec = importlib.util.spec_from_file_location("bench_vllm", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_vllm"] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class SideBySide:
    preset: str
    tokens: int
    moekit_us: float
    vllm_us: float
    flops: float
    moekit_rel_l2: float
    vllm_rel_l2: float
    tolerance: float
    moekit_config: dict

    @property
    def ratio(self) -> float:
        """vLLM time / moekit time: above 1, moekit is faster."""
        return self.vllm_us / self.moekit_us


def _shapes(peer, label: str, tiny: bool) -> tuple[str, dict]:
    """(vLLM preset name, its shape dict) for `label` ("name" or "name@ExKxHxI", either with
    "+fp8-channel")."""
    name, _, shape = label.partition("+")[0].partition("@")
    if name not in VLLM_PRESETS:
        sys.exit(f"unknown preset {name!r}: the vLLM side has {', '.join(VLLM_PRESETS)}")
    dims = dict(peer.PRESETS[name])
    if tiny:
        dims.update(peer.TINY[name])
    if shape:
        e, k, h, i = (int(v) for v in shape.split("x"))
        dims.update(E=e, K=k, H=h, I=i)
    return name, dims


def _moekit_spec(name: str, dims: dict, act_dtype: torch.dtype, per_channel: bool):
    from moekit.presets import fp8_channel, preset, reshaped
    from moekit.spec import WeightFormat

    spec = reshaped(preset(name), f"{dims['E']}x{dims['K']}x{dims['H']}x{dims['I']}")
    if per_channel:
        spec = fp8_channel(spec)
    if spec.weight_format is WeightFormat.MXFP4:  # vLLM's gpt-oss-120b preset is its BF16 path
        spec = replace(spec, weight_format=WeightFormat.BF16)
    if act_dtype != spec.act_dtype:  # --dry-run: fp32 (the interpreter's bf16 arithmetic is broken)
        spec = replace(spec, act_dtype=act_dtype)
        if not spec.weight_format.is_quantized:  # vLLM's Weights stores float weights in the act dtype
            spec = replace(spec, weight_format=WeightFormat.FP32)
    return spec


def _run_preset(peer, label: str, tokens, args, device, ceilings) -> list[SideBySide]:
    from moekit.app.bench import flushed_seconds
    from moekit.app.check import poison_allocator
    from moekit.kernels.base import DeviceInfo
    from moekit.ops import fused_moe, prepare_weights
    from moekit.planning.plan import plan
    from moekit.presets import FP8_CHANNEL_SUFFIX
    from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
    from moekit.routing import RoutingResult
    from moekit.weights import ExpertWeights

    name, dims = _shapes(peer, label, args.dry_run)
    act_dtype = torch.float32 if args.dry_run else torch.bfloat16
    quant = label.partition("+")[2]
    if quant and quant != FP8_CHANNEL_SUFFIX:
        sys.exit(f"{label}: the only suffix the vLLM comparison takes is +{FP8_CHANNEL_SUFFIX}")
    per_channel = quant == FP8_CHANNEL_SUFFIX
    spec = _moekit_spec(name, dims, act_dtype, per_channel)
    if per_channel:
        from vllm_channel import channel_experts, channel_weights

        shared = SimpleNamespace(**channel_weights(peer, dims, device, seed=0), b13=None, b2=None)
        moe = channel_experts(peer, vars(shared), dims)
    else:
        shared = peer.Weights(dims, device, act_dtype, seed=0)
        moe = peer.make_moe(shared, dims)
    weights = ExpertWeights(
        format=spec.weight_format,
        gate_layout=spec.gate_layout,
        w13=shared.w13,
        w2=shared.w2,
        w13_scale=shared.w13_scale,
        w2_scale=shared.w2_scale,
        b13=shared.b13,
        b2=shared.b2,
        fp8_scale=spec.fp8_scale,
    )
    info = DeviceInfo.of(device)
    flush = torch.empty(256 << 20 if device.type == "cuda" else 1, dtype=torch.int8, device=device)
    prepared = {}
    rows = []
    for t in tokens:
        x, topk_w, topk_ids = peer.make_inputs(dims, t, device, act_dtype, seed=1)
        routing = RoutingResult(weights=topk_w, ids=topk_ids)
        chosen = plan(spec, num_tokens=t, device=info)
        key = (chosen.kernel, chosen.config)
        if key not in prepared:
            prepared = {key: prepare_weights(weights, chosen)}  # one layer's copy at a time
        ours = prepared[key]
        expected = fused_moe_reference(x, weights, routing, spec=spec)
        workspaces = moe.workspaces(t, dims["K"], x.dtype, device)

        def moekit_call(ours=ours, x=x, routing=routing, chosen=chosen):
            return fused_moe(x, ours, routing, plan=chosen)

        def vllm_call(x=x, topk_w=topk_w, topk_ids=topk_ids, workspaces=workspaces):
            return moe.forward(x, topk_w, topk_ids, workspaces)

        errors = []
        for call in (moekit_call, vllm_call):
            out = call()
            out.fill_(math.nan)  # vLLM writes into its workspace again: the next call must fill all of it
            del out
            # moekit allocates its output: hand it memory full of NaN (what the caching allocator frees
            # next), so a row it never writes shows
            poison_allocator(device, num_bytes=4 * t * spec.H * spec.K * 4)
            errors.append(relative_l2_error(call(), expected))
        if device.type == "cuda":
            repeats = 20 if t <= 1024 else 10
            us = [
                flushed_seconds(call, device, flush, repeats=repeats) * 1e6
                for call in (moekit_call, vllm_call)
            ]
        else:  # --dry-run checks the plumbing and the numbers, not the speed
            us = [math.nan, math.nan]
        row = SideBySide(
            preset=label,
            tokens=t,
            moekit_us=us[0],
            vllm_us=us[1],
            flops=2.0 * t * spec.K * 3 * spec.H * spec.I,
            moekit_rel_l2=errors[0],
            vllm_rel_l2=errors[1],
            tolerance=tolerance(spec),
            moekit_config={"kernel": chosen.kernel, **chosen.config.as_dict()},
        )
        rows.append(row)
        errors_text = (
            f"rel L2 {row.moekit_rel_l2:.1e} / {row.vllm_rel_l2:.1e} (tolerance {row.tolerance:.0e})"
        )
        if ceilings is None:
            print(f"  {label} T={t}: not timed (dry run), moekit / vLLM {errors_text}", flush=True)
            continue
        moekit_rate = row.flops / (row.moekit_us * 1e-6)
        sustained = ceilings.matmul_rate(spec, sustained=True)
        print(
            f"  {label} T={t}: moekit {row.moekit_us:.1f} us, vLLM {row.vllm_us:.1f} us, "
            f"vLLM/moekit {row.ratio:.2f}, moekit {moekit_rate / 1e12:.0f} TFLOP/s "
            f"({100 * moekit_rate / ceilings.matmul_rate(spec):.0f} % of the dense rate"
            + ("" if sustained is None else f", {100 * moekit_rate / sustained:.0f} % of it sustained")
            + f"), moekit / vLLM {errors_text}",
            flush=True,
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm", type=Path, default=Path("peers/vllm"), help="folder get-vllm-fused-moe wrote")
    p.add_argument("--presets", default=",".join(VLLM_PRESETS))
    p.add_argument("--tokens", default="1,8,64,256,1024,4096,16384")
    p.add_argument("--json", default=None, help="write every row and the ceilings here")
    p.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, fp32, Triton interpreted")
    args = p.parse_args()
    peer = _load_peer(args.vllm)  # sets TRITON_INTERPRET=1 itself on --dry-run, before Triton loads
    # The peer's own defaults (Triton stand-ins for align, activation and FP8 quantization), except that
    # the interpreter's FP8 cast is wrong, so a dry run quantizes in torch as the peer's own dry run does.
    peer.align.set_impl("triton")
    peer.ops.set_act_impl("triton")
    peer.ops.set_quant_impl("torch" if args.dry_run else "triton")
    device = torch.device("cpu" if args.dry_run else "cuda")
    ceilings = None
    if not args.dry_run:
        from moekit.app.bench import measure_ceilings

        ceilings = measure_ceilings(device)
        print(f"ceilings: {ceilings.summary()} on {torch.cuda.get_device_name()}", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.dry_run:
        tokens = [t for t in tokens if t <= 64] or [1, 7]
    rows = []
    for label in args.presets.split(","):
        rows += _run_preset(peer, label, tokens, args, device, ceilings)
    bad = [r for r in rows if not (r.moekit_rel_l2 <= r.tolerance and r.vllm_rel_l2 <= r.tolerance)]
    for r in bad:
        print(
            f"OVER TOLERANCE: {r.preset} T={r.tokens} moekit {r.moekit_rel_l2:.2e}, vLLM {r.vllm_rel_l2:.2e}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"ceilings": asdict(ceilings) if ceilings else None, "rows": [asdict(r) for r in rows]}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

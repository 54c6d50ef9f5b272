"""Benchmarks: whole-layer time per token count, against the roofline and the unfused baseline, one run.

Data flow: measure the two ceilings on this GPU (device-to-device copy bandwidth, bf16 matmul rate)
-> for a preset, draw random weights on the GPU -> for each T: random tokens and router logits ->
for each kernel (the planner's choice and the unfused `torch_grouped` baseline): check against the
fp32 reference (output poisoned with NaN first, so unwritten elements show), capture route + fused_moe
in a CUDA graph, time its replays with CUDA events with L2 flushed before every call (as the peer
benchmark does; at small T the hit experts would otherwise sit in L2) -> roofline from the
bytes of the experts actually hit and 2*T*K*3*H*I FLOPs -> `BenchRecord`s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from moekit.app.timing import median_seconds
from moekit.kernels.base import DeviceInfo
from moekit.kernels.registry import default_registry
from moekit.ops import fused_moe, prepare_weights, route
from moekit.planning.plan import plan
from moekit.presets import cap_experts, preset_at
from moekit.reference import fused_moe_reference, relative_l2_error, tolerance
from moekit.spec import ActivationQuant, MoESpec
from moekit.synthetic import random_batch, random_layer

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_per_s: float  # bytes read + written per second, device-to-device copy
    bf16_flops_per_s: float  # dense bf16 matmul, 8192^3, random data
    fp8_flops_per_s: float | None = None  # dense FP8 e4m3 matmul (torch._scaled_mm), 8192^3; W8A8 roofline
    # The same matmuls after about 0.3 s of back-to-back load (`_sustained_rate`). A GPU at its power
    # cap lowers its clock after tens of ms of dense math (an H200: 1980 -> 1600 - 1650 MHz), and a layer
    # timed over many graph replays runs at that clock; the rates above come mostly from the first calls.
    bf16_sustained_flops_per_s: float | None = None
    fp8_sustained_flops_per_s: float | None = None

    def matmul_rate(self, spec: MoESpec, *, sustained: bool = False) -> float | None:
        """The rate the layer's GEMMs can reach: FP8 tensor cores for W8A8, bf16 otherwise; `sustained`:
        under sustained load (None where not measured)."""
        if spec.act_quant is not ActivationQuant.NONE and self.fp8_flops_per_s:
            return self.fp8_sustained_flops_per_s if sustained else self.fp8_flops_per_s
        return self.bf16_sustained_flops_per_s if sustained else self.bf16_flops_per_s

    def summary(self) -> str:
        """One line for a benchmark's header: every ceiling, "not measured" where one was not."""

        def rate(flops_per_s: float | None) -> str:
            return "not measured" if flops_per_s is None else f"{flops_per_s / 1e12:.0f} TFLOP/s"

        return (
            f"copy {self.copy_bytes_per_s / 1e12:.2f} TB/s, bf16 {rate(self.bf16_flops_per_s)} "
            f"({rate(self.bf16_sustained_flops_per_s)} sustained), FP8 {rate(self.fp8_flops_per_s)} "
            f"({rate(self.fp8_sustained_flops_per_s)} sustained)"
        )


@dataclass(frozen=True)
class BenchRecord:
    preset: str
    kernel: str
    config: dict
    tokens: int
    experts_hit: int
    us: float  # median microseconds per whole layer (graph replay)
    weight_bytes: int  # bytes of the experts actually hit
    flops: float
    roofline_us: float
    pct_roofline: float
    tb_per_s: float  # weight bytes / time
    tflops: float
    rel_l2: float
    ok: bool
    error: str | None = None  # why the kernel could not be timed (then us is NaN)


def measure_ceilings(device: torch.device) -> Ceilings:
    n = 1 << 29  # 1 GiB of bytes per buffer: far above L2
    a = torch.empty(n, dtype=torch.uint8, device=device).random_()
    b = torch.empty_like(a)
    copy_s = median_seconds(lambda: b.copy_(a), device, repeats=10)
    m = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    k = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_s = median_seconds(lambda: m @ k, device, repeats=10)
    bf16_sustained = _sustained_rate(lambda: m @ k, device)
    fp8_rate = fp8_sustained = None
    try:  # needs FP8 tensor cores (sm_89+); the W8A8 roofline falls back to the bf16 rate without them
        a8, b8 = m.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn).t()  # b column-major, as required
        one = torch.ones((), device=device)

        def fp8_mm():
            return torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

        fp8_rate = 2 * 8192**3 / median_seconds(fp8_mm, device, repeats=10)
        fp8_sustained = _sustained_rate(fp8_mm, device)
    except (RuntimeError, TypeError) as err:  # not measured on this device: say so, use the bf16 rate
        print(f"moekit bench: FP8 matmul ceiling not measured ({type(err).__name__}: {err})")
    return Ceilings(
        copy_bytes_per_s=2 * n / copy_s,
        bf16_flops_per_s=2 * 8192**3 / mm_s,
        fp8_flops_per_s=fp8_rate,
        bf16_sustained_flops_per_s=bf16_sustained,
        fp8_sustained_flops_per_s=fp8_sustained,
    )


def _sustained_rate(matmul, device: torch.device, *, calls: int = 20, load_replays: int = 10) -> float | None:
    """FLOP/s of an 8192^3 `matmul` once the GPU has run it back to back for `load_replays` replays of a
    graph of `calls` calls (about 0.3 s at bf16 on an H200): the median of 5 more replays. None, said
    aloud, where the matmul cannot be captured in a graph: the other ceilings stand without it."""
    try:
        graph, _ = capture_graph(matmul, device, repeats=calls)
    except RuntimeError as err:
        print(f"moekit bench: sustained matmul rate not measured ({type(err).__name__}: {err})")
        return None
    for _ in range(load_replays):
        graph.replay()
    return 2 * 8192**3 * calls / median_seconds(graph.replay, device, repeats=1, batches=5, warmup=0)


def capture_graph(fn, device: torch.device, *, repeats: int = 1, flush: torch.Tensor | None = None):
    """Capture `repeats` x ([zero the flush buffer]; fn) in one CUDA graph; returns (graph, last output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2 if fn is not None else 0):  # warm-up outside the graph: compilation, allocator
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    out = None
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            if flush is not None:
                flush.zero_()
            out = fn() if fn is not None else None
    return graph, out


def profiled_kernels(
    fn, device: torch.device, flush: torch.Tensor, *, repeats: int
) -> list[tuple[str, float]]:
    """(kernel name, its GPU µs / `repeats`) of every kernel launch in a graph of `repeats` x ([zero the
    flush buffer]; fn), replayed once under torch.profiler (CUPTI); the flush's own launches included.
    Summed by name, the µs are per call of `fn`."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = capture_graph(fn, device, repeats=repeats, flush=flush)
    graph.replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize(device)
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.device_time / repeats) for e in prof.events() if e.device_type == cuda]


def flushed_seconds(fn, device: torch.device, flush: torch.Tensor, *, repeats: int) -> float:
    """Per-call time with L2 flushed before every call, as the peer measures it:
    (graph[flush; fn] x n - graph[flush] x n) / n, medians of event-timed replays."""
    with_fn, _ = capture_graph(fn, device, repeats=repeats, flush=flush)
    only_flush, _ = capture_graph(None, device, repeats=repeats, flush=flush)
    return (
        median_seconds(with_fn.replay, device, repeats=1)
        - median_seconds(only_flush.replay, device, repeats=1)
    ) / repeats


def baseline_spec(spec: MoESpec) -> MoESpec:
    """The spec the unfused baseline runs: "dequantize, then bf16" — the same weights with activations
    left unquantized (W8A8 becomes W8A16), so the baseline can use `torch._grouped_mm` in bf16."""
    return replace(spec, act_quant=ActivationQuant.NONE)


def bench_preset(
    name: str,
    *,
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    kernels: tuple[str, ...] = ("planned", "torch_grouped"),
    ceilings: Ceilings,
    device: torch.device | str = "cuda",
    num_experts: int | None = None,
    progress=None,
) -> list[BenchRecord]:
    """Time each kernel at each T; a kernel that fails (capture, launch, memory) is recorded, not fatal.
    `name` is a preset or "preset@ExKxHxI" (`presets.preset_at`: its math at another shape)."""
    device = torch.device(device)
    spec = cap_experts(preset_at(name), num_experts)
    layer = random_layer(spec, seed=0, device=device)
    info = DeviceInfo.of(device)
    registry = default_registry()
    prepared: dict[str, object] = {}
    records: list[BenchRecord] = []
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device)  # 256 MiB: evicts the 60 MB L2
    for t in tokens:
        x, logits, routing = random_batch(
            spec, t, correction_bias=layer.correction_bias, seed=t, device=device
        )
        hit = int(routing.ids.unique().numel())
        expected: dict[MoESpec, torch.Tensor] = {}
        for which in kernels:
            run_spec = spec if which == "planned" else baseline_spec(spec)
            if run_spec not in expected:
                expected[run_spec] = fused_moe_reference(x, layer.weights, routing, spec=run_spec)
            chosen = plan(run_spec, num_tokens=t, device=info)
            if which != "planned":
                kernel = registry.get(which)
                chosen = replace(
                    chosen, kernel=which, config=kernel.default_config(run_spec, _problem(t, info))
                )
            try:
                seconds, rel = time_plan(
                    chosen, layer, x, logits, expected[run_spec], prepared, flush, device
                )
            except Exception as err:  # noqa: BLE001 - one kernel's failure must not hide the others' figures
                records.append(
                    make_record(
                        name,
                        spec,
                        chosen,
                        t,
                        hit,
                        math.nan,
                        math.inf,
                        ceilings,
                        error=f"{type(err).__name__}: {err}"[:300],
                    )
                )
                torch.cuda.empty_cache()
            else:
                records.append(make_record(name, spec, chosen, t, hit, seconds, rel, ceilings))
            if progress is not None:
                progress(records[-1])
    return records


def prepared_weights(chosen, layer, cache: dict):
    """`layer`'s weights as `chosen`'s kernel reads them, prepared once per (kernel, spec) in `cache`."""
    key = (chosen.kernel, chosen.spec)
    if key not in cache:
        cache[key] = prepare_weights(layer.weights, chosen)
    return cache[key]


def whole_layer(chosen, layer, weights, x, logits, *, check_values: bool = True):
    """The function the benchmarks time and profile: route `logits`, then run `chosen` on `x`."""
    spec = chosen.spec

    def call():
        r = route(logits, top_k=spec.K, spec=spec.routing, correction_bias=layer.correction_bias)
        return fused_moe(x, weights, r, plan=chosen, check_values=check_values)

    return call


def time_plan(chosen, layer, x, logits, expected, prepared, flush, device) -> tuple[float, float]:
    """(seconds per whole layer, rel L2 vs `expected`) for one plan: poisoned graph replay, then timing."""
    layer_fn = whole_layer(chosen, layer, prepared_weights(chosen, layer, prepared), x, logits)
    graph, out = capture_graph(layer_fn, device)
    out.fill_(float("nan"))  # poison: the replay must write every element
    graph.replay()
    torch.cuda.synchronize(device)
    rel = relative_l2_error(out, expected)
    del graph, out
    t = x.shape[0]
    return flushed_seconds(layer_fn, device, flush, repeats=20 if t <= 1024 else 10), rel


def _problem(t, info):
    from moekit.kernels.base import Problem

    return Problem(num_tokens=t, device=info)


def make_record(
    name, spec, chosen, t, hit, seconds, rel, ceilings: Ceilings, error: str | None = None
) -> BenchRecord:
    weight_bytes = hit * spec.expert_weight_bytes
    act_bytes = 2 * t * spec.H * torch.tensor([], dtype=spec.act_dtype).element_size()
    flops = 2.0 * t * spec.K * 3 * spec.H * spec.I
    roofline = max((weight_bytes + act_bytes) / ceilings.copy_bytes_per_s, flops / ceilings.matmul_rate(spec))
    return BenchRecord(
        preset=name,
        kernel=chosen.kernel,
        config=chosen.config.as_dict(),
        tokens=t,
        experts_hit=hit,
        us=seconds * 1e6,
        weight_bytes=weight_bytes,
        flops=flops,
        roofline_us=roofline * 1e6,
        pct_roofline=100 * roofline / seconds,
        tb_per_s=weight_bytes / seconds / 1e12,
        tflops=flops / seconds / 1e12,
        rel_l2=rel,
        ok=error is None and rel <= tolerance(spec),
        error=error,
    )


def records_as_json(records: list[BenchRecord], ceilings: Ceilings) -> dict:
    return {"ceilings": asdict(ceilings), "records": [asdict(r) for r in records]}


def plot_records(records: list[BenchRecord], path) -> None:
    """PNG: µs per layer (log-log) and % of roofline vs T, one line per (preset, kernel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_us, ax_pct) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[tuple[str, str], list[BenchRecord]] = {}
    for r in records:
        series.setdefault((r.preset, r.kernel), []).append(r)
    for (name, kernel), rs in series.items():
        rs = sorted(rs, key=lambda r: r.tokens)
        ts = [r.tokens for r in rs]
        ax_us.plot(ts, [r.us for r in rs], marker="o", label=f"{name} {kernel}")
        ax_pct.plot(ts, [r.pct_roofline for r in rs], marker="o", label=f"{name} {kernel}")
    for ax, label in ((ax_us, "µs per layer"), (ax_pct, "% of roofline")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    ax_us.set_yscale("log")
    ax_pct.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

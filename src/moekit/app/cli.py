"""The `moekit` command line.

Data flow: argv -> argparse subcommand -> the command's flag values checked (`_FLAG_CHECKS`) -> a job
function returning a typed report -> a rich table on screen, or JSON with `--json`. Errors print as one
line on stderr (`cli_errors`): exit status 2 for a flag the command refuses before any work, 1 for a job
that failed or a `MoekitError` raised while it ran.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from moekit.app.cli_errors import Parser, UsageError, flag_values, report, wants_json
from moekit.app.cli_parallel import (
    add_bench_parallel_flags,
    add_parallel_flags,
    bench_parallel_flags,
    parallel_flags,
    print_parallel_explanation,
    refuse_single_device_flags,
    run_bench_parallel,
)
from moekit.app.cli_spec import (
    SIMULATED_DEVICES,
    add_spec_flags,
    at_least,
    plan_as_dict,
    real_device,
    resolve_device,
    spec_from_flags,
    token_counts,
)
from moekit.errors import DeviceError, MoekitError, TunedTableError
from moekit.planning.tuned import ENV_VAR as TUNED_ENV_VAR
from moekit.presets import DEFAULT_PRESET, PRESETS

DESCRIPTION = """\
moekit runs Mixture-of-Experts layers (GPT-OSS MXFP4, DeepSeek FP8, Qwen/Mixtral BF16) and checks them
against a pure-PyTorch reference.

  moekit run                      run the default layer (gpt-oss-20b shapes, random weights)
  moekit run --tokens 8 --preset qwen3-30b-a3b
  moekit run --checkpoint DIR --layer 3    run one layer of a GPT-OSS or per-expert HF checkpoint
  moekit explain --preset gpt-oss-120b --tokens 1 --device h200
                                  which kernel and config the planner picks, and why
  moekit explain --preset deepseek-v3 --ep 64
  moekit explain --config /models/Qwen3-30B-A3B/config.json --ep 8
                                  the layer on 64 ranks on paper: per-rank weights, bytes moved,
                                  modeled communication time
  moekit check --all              every capable kernel here against the reference, all presets
  moekit bench --preset gpt-oss-120b --plot bench.png
                                  time whole layers on the GPU vs roofline and baseline
  moekit tune --preset gpt-oss-120b --table tuned.json
                                  autotune; then MOEKIT_TUNED_TABLE=tuned.json moekit explain ...

Exit status: 0 passed; 1 the job failed or moekit refused something while running; 2 a usage error
(a flag or flag value refused before any work). Errors are one line on stderr; with --json, stdout
holds JSON only: the report, or {"error": {"type", "message", "usage", "exit_status"}}.
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="moekit", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser(
        "run",
        help="run one MoE layer on random tokens, time it and self-check it",
        description="Build a layer (a preset with random weights, or a checkpoint layer), "
        "route random tokens through it, time it and check it against the "
        "fp32 reference.",
    )
    run.add_argument(
        "--preset",
        default=None,  # None: not given, so that --checkpoint can refuse it (default: DEFAULT_PRESET)
        choices=sorted(PRESETS),
        help=f"model shapes to build with random weights (default: {DEFAULT_PRESET}); not with --checkpoint",
    )
    run.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="a GPT-OSS safetensors file or directory (OpenAI or Hugging Face naming), or a Hugging Face "
        "folder with config.json and one tensor per expert (Mixtral, Qwen, OLMoE, DeepSeek-V2/V3, GLM-4.5, "
        "GLM-4.7-Flash, dots1, MiniMax-M2; float, FP8)",
    )
    run.add_argument(
        "--layer", type=int, default=None, help="layer index in --checkpoint (default: 0); needs --checkpoint"
    )
    run.add_argument("--tokens", type=int, default=4, help="tokens in the batch, T >= 1 (default: 4)")
    run.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of a table")

    explain = sub.add_parser(
        "explain",
        help="show which kernel and config a spec gets, and what was refused",
        description="Plan a layer the way moekit does when it is built, and print the "
        "chosen kernel, where its config came from, every refused "
        "candidate with its reason, and every rejected tuned row. Start "
        "from a preset; any spec flag overrides that field.",
    )
    explain.add_argument(
        "--preset",
        default=None,  # None: not given, so that --config can refuse it (default: DEFAULT_PRESET)
        choices=sorted(PRESETS),
        help=f"model spec to start from (default: {DEFAULT_PRESET}); not with --config",
    )
    explain.add_argument(
        "--config",
        type=Path,
        default=None,
        help="start from the MoE layer a Hugging Face config.json (or a model folder's) describes (Mixtral, "
        "Qwen, OLMoE, DeepSeek-V2/V3, GLM-4.5, GLM-4.7-Flash, dots1, MiniMax-M2; float or FP8 block-128), no "
        "tensors read",
    )
    explain.add_argument(
        "--tokens", type=int, default=None, help="tokens per forward, T (default: 1); not with --ep/--tp"
    )
    explain.add_argument(
        "--device",
        default=None,
        help="cpu, cuda, or a simulated GPU to plan for without one: "
        + ", ".join(sorted(SIMULATED_DEVICES))
        + " (default: cuda if present, else cpu)",
    )
    explain.add_argument(
        "--table", type=Path, default=None, help="a tuned table to merge over the shipped ones"
    )
    explain.add_argument("--strict", action="store_true", help="fail instead of falling back")
    explain.add_argument("--json", action="store_true", help="print one JSON object")
    add_parallel_flags(explain)
    add_spec_flags(explain)

    check = sub.add_parser(
        "check",
        help="check every capable kernel on this device against the reference",
        description="For a preset (or all presets), run every registered kernel that can "
        "compute the spec on this device, at several token counts, and compare "
        "with the fp32 reference. Kernels that refuse are listed with the reason.",
    )
    check.add_argument(
        "--preset",
        default=None,  # None: not given, so that --all can refuse it
        choices=sorted(PRESETS),
        help=f"the preset to check (default: {DEFAULT_PRESET}); not with --all",
    )
    check.add_argument("--all", action="store_true", help="check every preset")
    check.add_argument("--tokens", default="1,7,64", help="comma-separated token counts (default: 1,7,64)")
    check.add_argument(
        "--max-experts",
        type=int,
        default=None,
        help="cap E so the weights fit (default: none on a GPU, 8 on a CPU)",
    )
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    check.add_argument("--json", action="store_true", help="print JSON records instead of a table")

    bench = sub.add_parser(
        "bench",
        help="time whole layers on the GPU against the roofline and the baseline",
        description="Per preset and token count: microseconds per layer (CUDA-graph replay, "
        "L2 flushed), TB/s, TFLOP/s, %% of the roofline measured in the same run, "
        "and the ratio to the unfused torch._grouped_mm baseline. Needs CUDA.",
    )
    bench.add_argument("--preset", default="gpt-oss-120b", help="comma-separated presets")
    bench.add_argument("--tokens", default=",".join(str(t) for t in (1, 8, 64, 512, 4096)))
    bench.add_argument("--json", type=Path, default=None, help="write every figure to this file")
    bench.add_argument("--plot", type=Path, default=None, help="write a PNG of µs and %% roofline vs T")
    add_bench_parallel_flags(bench)

    tune = sub.add_parser(
        "tune",
        help="autotune kernels and configs for a preset; save verified rows",
        description="Time every capable kernel's candidate configs at each token count, "
        "check the fastest against the reference, and append the winner to a "
        "tuned table (atomically; an interrupted run resumes where it stopped). "
        f"Use the table with {TUNED_ENV_VAR}=PATH or plan(..., tuned=PATH).",
    )
    tune.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    tune.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512,1024,2048,4096")
    tune.add_argument(
        "--table",
        type=Path,
        default=Path("moekit-tuned.json"),
        help="table to write (default: ./moekit-tuned.json)",
    )
    tune.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    tune.add_argument("--max-experts", type=int, default=None, help="cap E (the table key records it)")
    return parser


def _cmd_run(args: argparse.Namespace, console: Console) -> int:
    from moekit.app.run import run_job

    report = run_job(
        preset_name=args.preset,
        checkpoint=args.checkpoint,
        layer=args.layer,
        num_tokens=args.tokens,
        seed=args.seed,
        device=args.device,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
        return 0 if report.check_passed else 1
    table = Table(title="moekit run", show_header=False)
    table.add_row("layer", report.source)
    table.add_row("spec", report.spec.describe())
    table.add_row("device", report.device)
    table.add_row("kernel", f"{report.plan.kernel} {report.plan.config.as_dict()}")
    table.add_row("config from", report.plan.source.value)
    table.add_row("tokens / experts hit", f"T={report.num_tokens}, {report.experts_hit} of {report.spec.E}")
    table.add_row("load-time prepare", f"{report.prepare_seconds * 1e3:.1f} ms -> {report.packing} packing")
    clock = "CUDA events, median of 7 x 20" if report.device.startswith("cuda") else "wall clock, median of 3"
    table.add_row("forward time", f"{report.seconds * 1e3:.3f} ms ({clock})")
    verdict = "[green]PASS[/green]" if report.check_passed else "[red]FAIL[/red]"
    table.add_row(
        "self-check",
        f"{verdict}: rel L2 {report.check_rel_l2:.2e} <= {report.check_tolerance:g} "
        f"vs {report.check_against} on {report.check_tokens} tokens",
    )
    console.print(table)
    return 0 if report.check_passed else 1


def _cmd_explain(args: argparse.Namespace, console: Console) -> int:
    from moekit.planning.plan import plan

    if args.parallel_mode is not None:
        return print_parallel_explanation(args, console)

    result = plan(args.spec, num_tokens=args.tokens, device=args.device, tuned=args.table, strict=args.strict)
    if args.json:
        print(json.dumps(plan_as_dict(result), indent=2))
    else:
        console.print(result.explain(), highlight=False, markup=False, soft_wrap=True)
    return 0


def _cmd_check(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    from moekit.app.check import check_preset
    from moekit.kernels.registry import default_registry

    device, tokens = args.device, args.tokens
    cap = args.max_experts if args.max_experts is not None else (8 if device.type == "cpu" else None)
    names = sorted(PRESETS) if args.all else [args.preset]
    records = []
    with Progress(console=console, transient=True, disable=args.json) as progress:
        task = progress.add_task("checking", total=len(names) * len(default_registry()) * len(tokens))
        for name in names:
            progress.update(task, description=f"checking {name}")
            records += check_preset(
                name,
                tokens=tokens,
                device=device,
                max_experts=cap,
                progress=lambda n: progress.advance(task, n),
            )
    if args.json:
        print(json.dumps([dict(r.__dict__, passed=r.passed) for r in records], indent=1))
    else:
        title = f"moekit check on {device}" + (f" (E capped at {cap})" if cap else "")
        table = Table(title=title)
        for col in ("preset", "kernel", "T", "rel L2", "tolerance", "result"):
            table.add_column(col)
        for r in records:
            if r.refused:
                table.add_row(r.preset, r.kernel, "-", "-", "-", f"[yellow]refused[/yellow]: {r.refused}")
            else:
                verdict = "[green]pass[/green]" if r.passed else "[red]FAIL[/red]"
                table.add_row(
                    r.preset, r.kernel, str(r.tokens), f"{r.rel_l2:.2e}", f"{r.tolerance:g}", verdict
                )
        console.print(table)
    return 0 if all(r.passed for r in records) else 1


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    import torch

    if args.parallel is not None:
        return run_bench_parallel(args, console)
    from rich.progress import Progress

    from moekit.app.bench import bench_preset, measure_ceilings, plot_records, records_as_json

    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    console.print(f"ceilings: {ceilings.summary()}")
    records = []
    names, tokens = args.preset.split(","), args.tokens
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarking", total=len(names) * len(tokens) * 2)  # planned + baseline
        for name in names:
            progress.update(task, description=f"benchmarking {name}")
            records += bench_preset(
                name,
                tokens=tokens,
                ceilings=ceilings,
                device=device,
                progress=lambda _record: progress.advance(task),
            )
    table = Table(title=f"moekit bench on {torch.cuda.get_device_name()}")
    for col in ("preset", "T", "kernel", "µs", "TB/s", "TFLOP/s", "% roofline", "rel L2"):
        table.add_column(col)
    for r in records:
        table.add_row(
            r.preset,
            str(r.tokens),
            r.kernel,
            f"{r.us:.1f}",
            f"{r.tb_per_s:.2f}",
            f"{r.tflops:.1f}",
            f"{r.pct_roofline:.0f}",
            f"{r.rel_l2:.1e}",
        )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(records_as_json(records, ceilings), indent=1))
    if args.plot:
        plot_records(records, args.plot)
    return 0 if all(r.ok for r in records) else 1


def _cmd_tune(args: argparse.Namespace, console: Console) -> int:
    from rich.progress import Progress

    from moekit.app.autotune import tune

    device, spec, tokens = args.device, args.spec, args.tokens
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"tuning {args.preset}", total=len(tokens))
        outcomes = tune(
            spec, tokens=tokens, device=device, table=args.table, progress=lambda _o: progress.advance(task)
        )
    table = Table(title=f"moekit tune {args.preset} on {device} -> {args.table}")
    for col in ("T", "winner", "config", "µs", "rel L2", "candidates (failed)"):
        table.add_column(col)
    for o in outcomes:
        if o.resumed:
            table.add_row(str(o.tokens), "(already in the table)", "", "", "", "")
        elif o.winner is None:
            table.add_row(str(o.tokens), "[red]none verified[/red]", "", "", "", str(len(o.candidates)))
        else:
            failed = sum(c.error is not None for c in o.candidates)
            table.add_row(
                str(o.tokens),
                o.winner.kernel,
                str(o.winner.config.as_dict()),
                f"{o.winner.seconds * 1e6:.1f}",
                f"{o.rel_l2:.1e}",
                f"{len(o.candidates)} ({failed})",
            )
    console.print(table)
    return 0 if all(o.resumed or o.winner is not None for o in outcomes) else 1


def _run_flags(args: argparse.Namespace) -> None:
    at_least("--tokens", args.tokens, 1, "a run on 0 tokens computes and self-checks nothing")
    if args.layer is not None and args.checkpoint is None:
        raise UsageError(
            f"--layer {args.layer} picks a layer of --checkpoint and would be ignored; add --checkpoint PATH"
        )
    if args.preset is not None and args.checkpoint is not None:
        raise UsageError(
            f"--preset {args.preset} picks random-weight shapes and would be ignored with --checkpoint "
            "(the layer's shapes are the checkpoint's); drop one"
        )
    args.preset = DEFAULT_PRESET if args.preset is None else args.preset
    args.layer = at_least("--layer", 0 if args.layer is None else args.layer, 0)
    args.device = real_device(args.device)


def _explain_flags(args: argparse.Namespace) -> None:
    refuse_single_device_flags(args)
    if args.config is not None and args.preset is not None:
        raise UsageError(f"--preset {args.preset} and --config {args.config} both name the layer; give one")
    args.preset = DEFAULT_PRESET if args.preset is None else args.preset
    args.tokens = at_least("--tokens", 1 if args.tokens is None else args.tokens, 0)
    if args.table is not None and not args.table.is_file():
        raise UsageError(f"--table {args.table}: no such file; give a tuned table written by moekit tune")
    args.spec = spec_from_flags(args)
    args.device = resolve_device(args.device)
    parallel_flags(args)


def _check_flags(args: argparse.Namespace) -> None:
    if args.all and args.preset is not None:
        raise UsageError(
            f"--preset {args.preset} checks one preset and would be ignored with --all; drop one"
        )
    args.preset = DEFAULT_PRESET if args.preset is None else args.preset
    args.device = real_device(args.device)
    args.tokens = token_counts(args.tokens, minimum=0)
    if args.max_experts is not None:
        at_least("--max-experts", args.max_experts, 1)


def _bench_flags(args: argparse.Namespace) -> None:
    import torch

    from moekit.presets import preset

    if bench_parallel_flags(args):
        return
    if not torch.cuda.is_available():
        raise DeviceError("moekit bench times GPU kernels and needs a CUDA device; on a CPU use moekit check")
    for name in args.preset.split(","):
        preset(name)
    args.tokens = token_counts(args.tokens, minimum=1)


def _tune_flags(args: argparse.Namespace) -> None:
    from moekit.app.autotune import check_table
    from moekit.kernels.registry import default_registry
    from moekit.presets import cap_experts, preset

    args.device = real_device(args.device)
    args.tokens = token_counts(args.tokens, minimum=1)
    if args.max_experts is not None:
        at_least("--max-experts", args.max_experts, 1)
    args.spec = cap_experts(preset(args.preset), args.max_experts)
    try:  # the table tune would write, checked now: a bad one must not cost a tuning run first
        check_table(args.table, registry=default_registry())
    except TunedTableError as err:
        raise UsageError(str(err).replace(f"tuned table {args.table}", f"--table {args.table}", 1)) from err


_FLAG_CHECKS = {
    "run": _run_flags,
    "explain": _explain_flags,
    "check": _check_flags,
    "bench": _bench_flags,
    "tune": _tune_flags,
}
_HANDLERS = {
    "run": _cmd_run,
    "explain": _cmd_explain,
    "check": _cmd_check,
    "bench": _cmd_bench,
    "tune": _cmd_tune,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    json_output = wants_json(argv)
    try:
        args = _build_parser().parse_args(argv)
        json_output = args.command in ("run", "explain", "check") and args.json
        with flag_values():
            _FLAG_CHECKS[args.command](args)
        return _HANDLERS[args.command](args, Console())
    except MoekitError as err:
        return report(err, json_output=json_output)


if __name__ == "__main__":
    sys.exit(main())

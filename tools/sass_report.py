#!/usr/bin/env python3
"""Report the properties a compiled Hopper (sm_90) kernel's speed rests on, no GPU needed: spills,
register-A wgmma, the inner K-loop's instructions, the waits that keep wgmma in flight.

Data flow: a kernel compiled for sm_90 (`hopper_compile.py`: the grouped GEMMs with the constexprs
`launch.py` would pass, the Gluon engines' GEMMs) -> `cuobjdump -sass` -> `properties` (local memory,
wgmma operands, K-loop size against the work of a K-step) and `loop_report` (the K-loop's opcodes: the
instructions between the loop's backward branch and its target); `ptxas_performance_warnings` (the codes
of ptxas' "Potential Performance Loss" notes, e.g. C7513: every wgmma of a kernel serialized);
`runtime_constexprs` (constexpr parameters of the kernel's functions that received a run-time value).

Usage: python tools/sass_report.py --gemm 1 --format words --block 16,64,128 --warps 4 --stages 3
       python tools/sass_report.py --gemm 2 --format w8a8 --block 16,64,128 --swap-ab
Formats: words (MXFP4_MMA_WORDS), mxfp4 (CHECKPOINT, tl.dot_scaled), bf16, and with FP8 activations per
1x128 group: w8a8 (FP8 weights, 128x128 block scales), w4a8 (MXFP4 CHECKPOINT bytes into FP8 operands).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import io
import os
import re
import subprocess
import tempfile

import triton
from hopper_compile import FORMATS, compile_gemm


def k_loop_spills(instructions: list[tuple[int, str]]) -> list[int]:
    """Local-memory loads and stores (spills) inside each K-loop (`mma_loops`) of `instructions`."""
    return [sum(unpredicated(t)[:3] in ("LDL", "STL") for _, t in loop) for loop in mma_loops(instructions)]


def wgmma_waits(instructions: list[tuple[int, str]]) -> list[int]:
    """The group counts of every `wgmma.wait_group` (WARPGROUP.DEPBAR.LE gsb0, N) among `instructions`."""
    return [
        int(m.group(1), 16)
        for _, t in instructions
        if (m := re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", t))
    ]


def issued_under_mma(loop: list[tuple[int, str]]) -> int:
    """Instructions a warp issues while a wgmma of its own is in flight: the work that overlaps the tensor
    cores inside one program. A wgmma is in flight from its issue (the first of its group) until a
    `wgmma.wait_group` (WARPGROUP.DEPBAR.LE gsb0, N) that leaves at most N of the committed groups
    (`gsb0` closes a group) open; `loop` runs twice so that what the previous iteration left in flight
    counts (for a whole kernel the second pass repeats the first)."""
    committed, group_open, issued = 0, False, 0
    for turn in range(2):
        for _, text in loop:
            op = unpredicated(text)
            wait = re.search(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+)", op)
            if wait:
                committed = min(committed, int(wait.group(1), 16))
            elif op.startswith(("HGMMA", "QGMMA")):
                group_open = "gsb0" not in op
                committed += not group_open
            elif turn == 1 and (committed or group_open) and not op.startswith("WARPGROUP"):
                issued += 1
    return issued


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(kernel.asm["cubin"])
        path = handle.name
    try:
        return subprocess.run(
            [_tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)


def all_instructions(kernel) -> list[tuple[int, str]]:
    """(address, instruction) of the whole kernel, in program order."""
    instructions = []
    for line in _cuobjdump(kernel, "-sass").splitlines():
        match = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if match:
            instructions.append((int(match.group(1), 16), match.group(2).strip()))
    return instructions


def _loops(instructions: list[tuple[int, str]], *, conditional: bool):
    """(first, last) address of each loop: a backward branch's target and the branch, in program order
    of the branches; `conditional`: predicated branches only."""
    pattern = r"@!?U?P\w+\s+BRA (0x[0-9a-f]+)" if conditional else r"BRA (0x[0-9a-f]+)"
    for address, text in instructions:
        branch = re.search(pattern, text)
        if branch and int(branch.group(1), 16) < address:
            yield int(branch.group(1), 16), address


def _body(instructions: list[tuple[int, str]], loop: tuple[int, int]) -> list[tuple[int, str]]:
    return [(a, t) for a, t in instructions if loop[0] <= a <= loop[1]]


def loop_instructions(kernel, instructions: list[tuple[int, str]] | None = None) -> list[tuple[int, str]]:
    """(address, instruction) of the K-loop: from the target of the last conditional backward branch
    to that branch. `instructions`: the kernel's `all_instructions`, when the caller already has them."""
    instructions = all_instructions(kernel) if instructions is None else instructions
    loops = list(_loops(instructions, conditional=True))
    if not loops:
        raise RuntimeError("no backward branch found: the kernel has no K-loop at this size")
    return _body(instructions, loops[-1])


def mma_loops(instructions: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """(address, instruction) bodies of a Gluon kernel's K-loops (one per specialization of its tile): the
    innermost of the loops closed by a conditional backward branch that issue a wgmma. Not its barrier
    spins, nor a wait's retry (an unconditional jump back from a stub past the code, spanning all between),
    nor a persistent program's tile loop (it holds K-loops)."""
    spans = [
        loop
        for loop in _loops(instructions, conditional=True)
        if any(unpredicated(t).startswith(("HGMMA", "QGMMA")) for _, t in _body(instructions, loop))
    ]
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    if not inner:
        raise RuntimeError(f"no loop issues a wgmma among {len(instructions)} instructions")
    return [_body(instructions, loop) for loop in inner]


def unpredicated(text: str) -> str:
    """An instruction without its predicate (@P0, @!UP1 ...)."""
    return re.sub(r"^@!?U?P\w+\s+", "", text)


def _resources(kernel) -> dict[str, int]:
    """REG, STACK, SHARED and LOCAL bytes or counts of a compiled kernel (cuobjdump -res-usage)."""
    usage = _cuobjdump(kernel, "-res-usage")
    return {name: int(value) for name, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage)}


def loop_report(kernel) -> dict:
    body = [unpredicated(t).split()[0] for _, t in loop_instructions(kernel)]
    resources = _resources(kernel)
    return {
        "loop_instructions": len(body),
        "opcodes": collections.Counter(body).most_common(),
        "registers": resources.get("REG", 0),
        "local_bytes": resources.get("LOCAL", 0),
        "shared_bytes": kernel.metadata.shared,
    }


def _wgmma_operands(instructions: list[tuple[int, str]]) -> tuple[int, int]:
    """(register-A, shared-A) wgmma among `instructions`, bf16 (HGMMA) or FP8 (QGMMA): `HGMMA ... Rc, Ra,
    gdesc[..]` reads A from registers, `HGMMA ... Rc, gdesc[..]` from shared memory."""
    register_a = shared_a = 0
    for _, text in instructions:
        op = unpredicated(text)
        if op.startswith(("HGMMA", "QGMMA")):
            if re.match(r"[HQ]GMMA\S+\s+R\d+, R\d+,", op):
                register_a += 1
            else:
                shared_a += 1
    return register_a, shared_a


def decoded_pairs_per_thread(gemm: int, block: tuple[int, int, int], warps: int) -> int:
    """bf16 pairs each thread decodes per K-step of the MXFP4 word path: the tile's weight rows (GEMM1
    loads gate and up, 2 * block_n) x block_k elements, two a pair, over 32 * warps threads."""
    rows = 2 * block[1] if gemm == 1 else block[1]
    return rows * block[2] // (2 * 32 * warps)


def ptxas_performance_warnings(compile_kernel) -> list[str]:
    """The codes of ptxas' "Potential Performance Loss" notes (C7513: every wgmma of the kernel serialized,
    and the like) while `compile_kernel()` compiles a kernel. A kernel from Triton's cache prints no log:
    compile into an empty cache (TRITON_CACHE_DIR)."""
    log = io.StringIO()
    dump = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compile_kernel()
    finally:
        triton.knobs.nvidia.dump_ptxas_log = dump
    return sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss", log.getvalue())))


def runtime_constexprs(compile_kernel) -> list[str]:
    """`function.PARAM` for every `constexpr` parameter of a jit or Gluon function that received a run-time
    value while `compile_kernel()` compiled a kernel. Triton accepts one silently and generates code for a
    value known only when the kernel runs: a tuple of constexprs bound to an unannotated name and passed on
    turns them into tensors, so a ring index's modulo becomes an integer division and every branch of an
    activation is compiled. A cached kernel is not compiled again: compile into an empty cache."""
    from triton.compiler import code_generator
    from triton.language import core

    found: set[str] = set()
    call = code_generator.CodeGenerator.call_JitFunction

    def watched(self, fn, args, kwargs, caller_context=None):
        args = list(args)  # a one-pass iterable where Gluon's warp_specialize calls its partitions
        bound = inspect.getcallargs(fn.fn, *args, **kwargs)
        for param in fn.params:
            value = bound[param.name]
            if param.is_constexpr and isinstance(value, core.tensor):
                found.add(f"{fn.fn.__name__}.{param.name}")
        return call(self, fn, args, kwargs, caller_context)

    code_generator.CodeGenerator.call_JitFunction = watched
    try:
        compile_kernel()
    finally:
        code_generator.CodeGenerator.call_JitFunction = call
    return sorted(found)


def kernel_facts(kernel, instructions: list[tuple[int, str]] | None = None) -> dict:
    """Whole-kernel facts of any compiled kernel, looped or not: `local_bytes` / `local_memory_ops`
    (spills: LDL / STL anywhere), `registers`, `instructions` and CTA-wide `barriers` (BAR)."""
    instructions = all_instructions(kernel) if instructions is None else instructions
    ops = [unpredicated(t) for _, t in instructions]
    resources = _resources(kernel)
    return {
        "local_bytes": resources.get("LOCAL", 0),
        "local_memory_ops": sum(1 for op in ops if re.match(r"(LDL|STL)\b", op)),
        "registers": resources.get("REG", 0),
        "instructions": len(ops),
        "barriers": sum(1 for op in ops if op.startswith("BAR")),
    }


def properties(kernel) -> dict:
    """What the H200 speed of a compiled GEMM rests on: `kernel_facts` (spills, registers), the K-loop's
    `loop_instructions` and its wgmma by operand source (`register_a_wgmma`, `shared_a_wgmma`), those on
    FP8 operands (`fp8_wgmma`) among them."""
    instructions = all_instructions(kernel)
    loop = loop_instructions(kernel, instructions)
    register_a, shared_a = _wgmma_operands(loop)
    return {
        **kernel_facts(kernel, instructions),
        "loop_instructions": len(loop),
        "register_a_wgmma": register_a,
        "shared_a_wgmma": shared_a,
        "fp8_wgmma": sum(1 for _, t in loop if unpredicated(t).startswith("QGMMA")),
        "issued_under_mma": issued_under_mma(loop),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gemm", type=int, choices=(1, 2), default=2)
    p.add_argument("--format", choices=FORMATS, default="words")
    p.add_argument("--block", default="16,64,128", help="block_m,block_n,block_k")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--split-k", type=int, default=1)
    p.add_argument("--max-registers", type=int, default=None, help="ptxas register cap (max_registers)")
    p.add_argument("--swap-ab", action="store_true", help="weight rows on the MMA's M side")
    p.add_argument(
        "--model",
        choices=("gpt-oss", "deepseek"),
        default="gpt-oss",
        help="the layer's shape and math: gpt-oss (H = I = 2880, INTERLEAVED, SWIGLU_OAI, biases) or "
        "deepseek (H = 7168, I = 2048, CONCAT, SiLU, no biases)",
    )
    args = p.parse_args()
    block = tuple(int(v) for v in args.block.split(","))
    kernel = compile_gemm(
        args.gemm,
        args.format,
        block,
        args.warps,
        args.stages,
        args.split_k,
        swap_ab=args.swap_ab,
        model=args.model,
        max_registers=args.max_registers,
    )
    report, props = loop_report(kernel), properties(kernel)
    print(
        f"GEMM{args.gemm} {args.format} block {block} warps {args.warps} stages {args.stages}: "
        f"{report['loop_instructions']} SASS instructions per K-step, {report['registers']} registers, "
        f"{report['local_bytes']} B local (spills), {report['shared_bytes']} B shared"
    )
    print("  " + ", ".join(f"{op} {n}" for op, n in report["opcodes"]))
    print(
        f"  {props['local_memory_ops']} local loads / stores, K-loop wgmma: {props['register_a_wgmma']} "
        f"register-A, {props['shared_a_wgmma']} shared-A, {props['fp8_wgmma']} of them FP8; "
        f"{props['issued_under_mma']} of the K-step's instructions issue while its MMA is in flight"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

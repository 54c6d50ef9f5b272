"""Programmatic dependent launch is only safe if every kernel launched with it waits for the kernel
before it before touching memory (`kernels/triton/_details/pdl.py`). Checked on the source, for every
jit kernel of the Triton path that takes the `PDL` switch, and on the launch helper."""

import ast
import inspect

import pytest
import torch

from moekit.kernels.triton import pdl
from moekit.kernels.triton._details import align, gemm, quant, reduce, route

MODULES = (align, gemm, quant, reduce, route)


def _kernels_with_pdl() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for module in MODULES:
        for node in ast.parse(inspect.getsource(module)).body:
            if isinstance(node, ast.FunctionDef) and "PDL" in {a.arg for a in node.args.args}:
                found.append((f"{module.__name__}.{node.name}", node))
    return found


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
        body = body[1:]
    return body[0]


def test_the_layer_kernels_take_the_pdl_switch():
    names = {name.rsplit(".", 1)[1] for name, _ in _kernels_with_pdl()}
    launched = {"_route_softmax", "_route_sigmoid_grouped", "_align_pairs", "_align_count", "_align_scan"}
    launched |= {"_align_scatter", "_split_tail_blocks", "_pair_rows", "_quant_fp8_rows", "_quant_fp8_groups"}
    launched |= {"_quant_fp8_groups_sorted", "_moe_gemm1", "_moe_gemm2", "_moe_gemm1_splits", "_moe_sum_k"}
    assert launched <= names, launched - names


@pytest.mark.parametrize(("name", "fn"), _kernels_with_pdl(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_pdl_kernel_waits_for_its_predecessor_first(name, fn):
    first = _first_statement(fn)
    call = first.value if isinstance(first, ast.Expr) else None
    assert (
        isinstance(call, ast.Call)
        and getattr(call.func, "id", None) == "_pdl_prologue"
        and [getattr(a, "id", None) for a in call.args] == ["PDL"]
    ), f"{name} must start with _pdl_prologue(PDL): a PDL launch may start before the kernel before it ends"


def test_pdl_is_off_off_the_gpu():
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}

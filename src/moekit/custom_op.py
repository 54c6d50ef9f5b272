"""The `moekit::fused_moe_layer` custom op: how a `FusedMoE` forward crosses torch.compile and CUDA graphs.

Data flow:
  `FusedMoE.forward` (traced by dynamo) -> router logits -> `torch.ops.moekit.fused_moe_layer(x [T, H],
  router_logits [T, E], handle)`
  -> compiled graphs: the fake implementation returns an empty `[T, H]` of x's dtype, so the op is opaque,
     T stays a symbolic size and nothing in the graph depends on the token bucket (no recompiles);
  -> at run time (eager, compiled or during CUDA-graph capture): the real implementation looks the layer up
     by `handle` in a process-wide registry and calls `layer.run_flat(x, router_logits)`, which picks the
     bucket's plan from the host-side shape, routes and launches the kernel.

Why a handle: an op's arguments are tensors and scalars, not modules, and the weights, plans and kernel
choice must stay out of the graph (they are host-side state). vLLM solves this with a static layer name;
here an int from a counter names each live layer. The registry holds weak references, so a layer that is
no longer used is freed and its handle disappears; a handle is never reused.

The op serves inference: its autograd formula saves nothing and raises `ArgumentError` on backward, so a
training loop learns that from moekit rather than from PyTorch's "no autograd formula" error. A forward
under grad mode still runs (a Hugging Face model evaluated without `torch.no_grad()` works).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Protocol

import torch

from moekit.errors import ArgumentError, MoekitError

OP_NAME = "moekit::fused_moe_layer"


class LayerRunner(Protocol):
    """What the op needs of a layer: compute `[T, H]` from flat tokens and their router logits."""

    def run_flat(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor: ...


_LOCK = threading.Lock()
_LAYERS: dict[int, weakref.ref] = {}
_NEXT_HANDLE = itertools.count(1)


def register_layer(layer: LayerRunner) -> int:
    """Give `layer` a fresh handle; the entry disappears when the layer is garbage collected."""
    with _LOCK:
        handle = next(_NEXT_HANDLE)

        def _forget(_ref: weakref.ref, handle: int = handle) -> None:
            with _LOCK:
                _LAYERS.pop(handle, None)

        _LAYERS[handle] = weakref.ref(layer, _forget)
    return handle


def unregister_layer(handle: int) -> None:
    """Drop a handle explicitly (a layer being torn down); unknown handles are ignored."""
    with _LOCK:
        _LAYERS.pop(handle, None)


def lookup_layer(handle: int) -> LayerRunner:
    """The live layer behind `handle`, or a `MoekitError` saying why there is none."""
    ref = _LAYERS.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise MoekitError(
            f"no live moekit layer has handle {handle}: the FusedMoE was freed (or this handle came from "
            "another process); keep a reference to the module while graphs that call it are in use"
        )
    return layer


def live_handles() -> tuple[int, ...]:
    with _LOCK:
        return tuple(h for h, ref in _LAYERS.items() if ref() is not None)


@torch.library.custom_op(OP_NAME, mutates_args=())
def fused_moe_layer(x: torch.Tensor, router_logits: torch.Tensor, handle: int) -> torch.Tensor:
    """x `[T, H]` (the layer's act dtype), router_logits `[T, E]` (float) -> `[T, H]` in x's dtype."""
    return lookup_layer(handle).run_flat(x, router_logits)


@fused_moe_layer.register_fake
def _fused_moe_layer_fake(x: torch.Tensor, router_logits: torch.Tensor, handle: int) -> torch.Tensor:
    # Shapes only: the layer checked H, dtype and device before calling, and the bucket does not matter
    # to the graph. torch._check records the relation instead of specializing T.
    torch._check(x.dim() == 2 and router_logits.dim() == 2, lambda: "x and router_logits must be 2-D")
    torch._check(router_logits.shape[0] == x.shape[0], lambda: "router_logits must have one row per token")
    return x.new_empty(x.shape[0], x.shape[1])


def _no_saved_context(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    """Nothing to save: backward only refuses."""


def _refuse_backward(ctx: object, grad_output: torch.Tensor) -> tuple[None, None, None]:
    raise ArgumentError(
        "FusedMoE is inference-only (moekit has no backward for its kernels): run the layer under "
        "torch.no_grad() or torch.inference_mode(), or detach its input; to train, use the unpatched "
        "model (moekit.integrations.transformers.unpatch)"
    )


fused_moe_layer.register_autograd(_refuse_backward, setup_context=_no_saved_context)

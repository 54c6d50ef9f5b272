"""The kernel registry: the candidates the planner chooses among.

Data flow: kernel classes -> one instance each in a `KernelRegistry` (ordered by priority) ->
`plan()` filters them by `supports` and picks. The default registry holds the reference, the
unfused PyTorch path, and the Triton kernels when Triton imports (a GPU machine).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from moekit.kernels.base import Kernel
from moekit.kernels.reference import ReferenceKernel
from moekit.kernels.torch_grouped import TorchGroupedKernel


class KernelRegistry:
    """An immutable, name-indexed set of kernels, highest priority first."""

    def __init__(self, kernels: Iterable[Kernel]) -> None:
        ordered = sorted(kernels, key=lambda k: (-k.priority, k.name))
        names = [k.name for k in ordered]
        if len(set(names)) != len(names):
            raise ValueError(f"kernel names must be unique, got {names}")
        self._kernels = tuple(ordered)
        self._by_name = {k.name: k for k in ordered}

    def __iter__(self):
        return iter(self._kernels)

    def __len__(self) -> int:
        return len(self._kernels)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def get(self, name: str) -> Kernel | None:
        return self._by_name.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self._kernels)

    def with_kernels(self, *extra: Kernel) -> KernelRegistry:
        return KernelRegistry([*self._kernels, *extra])

    def without(self, *names: str) -> KernelRegistry:
        return KernelRegistry([k for k in self._kernels if k.name not in names])


def _optional_kernels() -> list[Kernel]:
    try:
        from moekit.kernels.triton.kernel import TritonFusedKernel
    except ImportError:  # no Triton on this machine: its kernels are simply not candidates
        return []
    return [TritonFusedKernel()]


@functools.cache
def default_registry() -> KernelRegistry:
    return KernelRegistry([ReferenceKernel(), TorchGroupedKernel(), *_optional_kernels()])

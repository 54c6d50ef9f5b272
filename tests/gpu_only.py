"""What the compiled-GPU test files share: their module-level gate and a count of Triton compilations."""

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch


def skip_unless_compiled_gpu() -> None:
    """Skip the calling test module unless Triton can compile for a CUDA GPU in this process."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 is set in this process: Triton would not compile for the GPU",
            allow_module_level=True,
        )
    pytest.importorskip("triton")


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """Yield a list that receives `module.kernel` for every Triton kernel compiled inside the block.

    Triton calls `knobs.runtime.jit_post_compile_hook` each time a JIT function adds a kernel to its
    in-process cache, whether it compiled it or loaded it from the on-disk cache, so a served forward
    that needed a kernel warmup did not prepare is counted even when the disk cache is warm. A Triton
    without the hook raises here instead of counting nothing; callers also assert that the warmup they
    measure counted something, so a hook that stopped firing fails too.
    """
    from triton import knobs

    seen: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        fn = kwargs["fn"]
        seen.append(f"{fn.module}.{fn.name}")
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_post_compile_hook = previous

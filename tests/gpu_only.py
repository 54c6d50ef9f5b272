"""The module-level gate of the compiled-GPU test files (`test_triton_gpu.py`, `test_layer_gpu.py`)."""

import os

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

"""Session set-up: on a machine without CUDA, Triton kernels can only run in its interpreter.

TRITON_INTERPRET must be set before Triton is first imported (moekit's registry imports it), so it is
set here, once, for the whole CPU session: the interpreter tests then run in the same pytest process
as everything else. On a GPU machine it is left alone, so the GPU tests compile real kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

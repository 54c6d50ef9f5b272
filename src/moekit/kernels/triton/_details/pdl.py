"""Programmatic dependent launch (PDL) inside the layer's kernels: the first statement of each.

A kernel launched with PDL (`moekit.kernels.triton.pdl.pdl_args`) may be launched once every program of
the kernel before it in the stream has exited, before that grid's completion is processed, which
hides part of the launch latency between the layer's short kernels (route, align, both GEMMs, the
top-k sum). `griddepcontrol.wait` then holds every program until that kernel has completed and its
writes are visible, so nothing is read (or overwritten) early; and since every program waits before
anything else, a kernel's completion still implies its predecessor's, as the kernels after it assume.

No kernel calls `griddepcontrol.launch_dependents` (a program's exit is the trigger): with it at each
kernel's start, the next kernels launched while this one ran and their programs waited in the slots it
left free. On an H200 that won Qwen3-30B 1 - 7 % at T = 1 - 16 but lost gpt-oss-120b 8 - 10 % at
T = 1 - 2 (44.5 -> 48.3 us: its one-wave split-K decode chain), where the exit trigger is 0 - 1.6 %
ahead of no PDL for both.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel's writes (PDL launches only: the interpreter has no inline PTX)."""
    if PDL:
        gdc_wait()

"""Programmatic dependent launch (PDL) inside the layer's kernels: the first statement of each.

A kernel launched with PDL (`moekit.kernels.triton.pdl.pdl_args`) may start while the kernel before it
in the stream is still finishing, which hides the launch latency between the layer's short kernels
(route, align, both GEMMs, the top-k sum). `griddepcontrol.wait` then holds every program until that
kernel has completed and its writes are visible, so nothing is read (or overwritten) early; and since
every program waits before anything else, a kernel's completion still implies its predecessor's, as
the kernels after it assume. `griddepcontrol.launch_dependents` lets the next kernel launch as soon as
every program of this one has started: its programs only wait, in slots this kernel no longer needs.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel launch (PDL launches only: the
    interpreter has no inline PTX)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

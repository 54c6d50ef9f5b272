"""moekit's exceptions.

Data flow: a spec, weights, inputs, a tuned table or a plan request that is wrong -> the module that
finds it raises one of these -> the caller sees what was wrong and what to do.

Every error moekit raises on bad input derives from `MoekitError`, names the offending values and
says what to do. Each subclass also derives from the built-in exception a Python user would expect
(`ValueError`, `TypeError`), so generic handlers keep working.
"""

from __future__ import annotations


class MoekitError(Exception):
    """Base class of every moekit error."""


class SpecError(MoekitError, ValueError):
    """A `MoESpec` (or one of its parts) has inconsistent or out-of-range fields."""


class ShapeError(MoekitError, ValueError):
    """A tensor has the wrong shape for the spec."""


class DTypeError(MoekitError, TypeError):
    """A tensor has the wrong dtype for the spec."""


class DeviceError(MoekitError, ValueError):
    """Tensors that must live together are on different devices, or on an unsupported device."""


class ExpertIdError(MoekitError, ValueError):
    """Routing produced expert ids outside `[0, E)`, or an expert map is malformed."""


class LayoutMismatchError(MoekitError, ValueError):
    """Weights carry a gate layout (or packing) other than the one the spec or kernel reads."""


class FormatError(MoekitError, ValueError):
    """Quantized data is invalid (NaN scale bytes, wrong container dtype, bad quantizer input)."""


class CheckpointError(MoekitError, ValueError):
    """A checkpoint is missing a tensor, or a tensor in it has the wrong shape or dtype."""


class UnsupportedSpecError(MoekitError, ValueError):
    """No registered kernel can compute this spec; raised when a plan is built."""


class TunedTableError(MoekitError, ValueError):
    """A tuned table (or one of its rows) is malformed; raised in strict mode or by the table writer."""


class PlanFallbackError(MoekitError, RuntimeError):
    """`strict=True` planning met a fallback (missing, nearest or rejected tuned row)."""

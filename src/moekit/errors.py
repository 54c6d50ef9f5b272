"""moekit's exceptions, and the field checks that raise them.

Data flow: a spec, weights, inputs, a tuned table or a plan request that is wrong -> the module that
finds it raises one of these (a field of the wrong type through `check_int`, `check_real`,
`check_bool`, `check_enum` or `check_type`) -> the caller sees what was wrong and what to do.

Every error moekit raises on bad input derives from `MoekitError`, names the offending values and
says what to do. Each subclass also derives from the built-in exception a Python user would expect
(`ValueError`, `TypeError`), so generic handlers keep working.
"""

from __future__ import annotations

import enum
import math


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


class NonFiniteError(MoekitError, ValueError):
    """Values that must be finite are not: router logits holding NaN or +-inf."""


class CheckpointError(MoekitError, ValueError):
    """A checkpoint is missing a tensor, or a tensor in it has the wrong shape or dtype."""


class UnsupportedSpecError(MoekitError, ValueError):
    """No registered kernel can compute this spec; raised when a plan is built."""


class TunedTableError(MoekitError, ValueError):
    """A tuned table (or one of its rows) is malformed; raised in strict mode or by the table writer."""


class PlanFallbackError(MoekitError, RuntimeError):
    """`strict=True` planning met a fallback (missing, nearest or rejected tuned row)."""


class ArgumentError(MoekitError, ValueError, TypeError):
    """A public function's argument has the wrong type or range, and no narrower error class fits."""


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - an int past str()'s digit limit, an object whose repr raises
        text = f"<a {type(value).__name__} that cannot be shown>"
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _field_error(error: type[MoekitError], where: str, value: object, need: str, fix: str) -> MoekitError:
    return error(f"{where} must be {need}, got {_shown(value)}; {fix}")


def _int_text(text: str) -> int | None:
    """The int a string spells in ASCII decimal digits ("12", " -3"), else None ("²", "1e3", "")."""
    body = text.strip()
    digits = body[1:] if body[:1] in "+-" else body
    return int(body) if digits.isascii() and digits.isdigit() else None


def check_int(
    where: str,
    value: object,
    *,
    minimum: int | None = None,
    optional: bool = False,
    error: type[MoekitError] = SpecError,
) -> None:
    """`value` is an int (not a bool, not a float however whole) >= `minimum`, or None if `optional`."""
    if optional and value is None:
        return
    bound = {None: "an int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
    need = ("None or " if optional else "") + bound
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            fix = f"pass the int {int(value)}"
        elif isinstance(value, str) and (number := _int_text(value)) is not None:
            fix = f"pass the number {number}, not a string"
        else:
            fix = "pass a Python int"
        raise _field_error(error, where, value, need, fix)
    if minimum is not None and value < minimum:
        raise _field_error(error, where, value, need, f"pass a value >= {minimum}")


def check_real(
    where: str,
    value: object,
    *,
    positive: bool = False,
    optional: bool = False,
    error: type[MoekitError] = SpecError,
) -> None:
    """`value` is a finite real number (int or float, not a bool or a string), > 0 if `positive`."""
    if optional and value is None:
        return
    need = ("None or " if optional else "") + "a finite number" + (" > 0" if positive else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _field_error(error, where, value, need, "pass a Python float or int")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        finite = False
    if not finite or (positive and value <= 0):
        raise _field_error(error, where, value, need, "pass a finite value" + (" > 0" if positive else ""))


def check_bool(where: str, value: object, *, error: type[MoekitError] = SpecError) -> None:
    """`value` is True or False; a string such as "no" would otherwise read as true."""
    if not isinstance(value, bool):
        # A string is truthy whatever it says, and 0/1 or a float hide a typo: only a bool is taken.
        hint = f" (Python reads {value!r} as {bool(value)})" if isinstance(value, str) else ""
        raise _field_error(error, where, value, "True or False", f"pass a Python bool{hint}")


def check_enum(
    where: str,
    value: object,
    enum_type: type[enum.Enum],
    *,
    optional: bool = False,
    error: type[MoekitError] = SpecError,
) -> None:
    """`value` is a member of `enum_type` (or None if `optional`); a string names the member to pass."""
    if (optional and value is None) or isinstance(value, enum_type):
        return
    members = ", ".join(f"{enum_type.__name__}.{m.name}" for m in enum_type)
    need = ("None or " if optional else "") + f"a {enum_type.__name__}"
    match = None
    if isinstance(value, str):
        match = next((m for m in enum_type if value.lower() in (m.name.lower(), str(m.value).lower())), None)
    fix = f"pass {enum_type.__name__}.{match.name}" if match else f"pass one of {members}"
    raise _field_error(error, where, value, need, fix)


def check_type(
    where: str,
    value: object,
    types: type | tuple[type, ...],
    *,
    fix: str,
    optional: bool = False,
    error: type[MoekitError] = ArgumentError,
) -> None:
    """`value` is an instance of `types` (or None if `optional`)."""
    if (optional and value is None) or isinstance(value, types):
        return
    names = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
    raise _field_error(error, where, value, ("None or " if optional else "") + f"a {names}", fix)

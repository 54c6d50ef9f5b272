"""Which launches use programmatic dependent launch (see `_details/pdl.py` for what the kernels do)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch


@functools.cache
def pdl_args(device: torch.device) -> Mapping[str, bool]:
    """Keyword arguments for a launch of a layer kernel on `device`: PDL on Hopper and later GPUs (the
    `launch_pdl` launch attribute and the kernel's `PDL` switch together), off elsewhere (the
    interpreter, older GPUs). Computed once per device (an index-less "cuda" is the current device), so
    the layer's launches pay a lookup; read-only, as every launch shares it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return MappingProxyType({"PDL": False})
    return MappingProxyType({"PDL": True, "launch_pdl": True})

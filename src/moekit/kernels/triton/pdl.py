"""Which launches use programmatic dependent launch (see `_details/pdl.py` for what the kernels do)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _capable(device: torch.device) -> bool:  # an index-less "cuda" is the current device
    return torch.cuda.get_device_capability(device) >= (9, 0)


def pdl_args(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for a launch of a layer kernel on `device`: PDL on Hopper and later GPUs (the
    `launch_pdl` launch attribute and the kernel's `PDL` switch together), off elsewhere (the
    interpreter, older GPUs)."""
    if device.type != "cuda" or not _capable(device):
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}

"""A spy on moekit's safetensors reads: which tensors' data a loader reads, and how many bytes.

`spy_reads(monkeypatch)` (a test's `reads` fixture calls it) patches `moekit.checkpoint.files.safe_open`,
the one place moekit opens safetensors files, so every `get_tensor` and every `get_slice(key)[index]`
logs (key, bytes returned); headers (`keys`, `get_shape`, `get_dtype`) are not data and are not logged.
"""

from __future__ import annotations

import pytest
import torch

import moekit.checkpoint.files as ckpt_files


class SpySlice:
    def __init__(self, view, log: list[tuple[str, int]], key: str) -> None:  # noqa: ANN001 - safetensors'
        self._view, self._log, self._key = view, log, key

    def __getattr__(self, name: str):  # noqa: ANN204 - get_shape, get_dtype: metadata, no data
        return getattr(self._view, name)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - whatever safetensors' slices take
        t = self._view[index]
        self._log.append((self._key, t.nbytes))
        return t


class SpyFile:
    """A safetensors handle that logs (key, bytes) of every tensor data read through it."""

    def __init__(self, f, log: list[tuple[str, int]]) -> None:  # noqa: ANN001 - a safetensors handle
        self._f, self._log = f, log

    def __enter__(self) -> SpyFile:
        self._f.__enter__()
        return self

    def __exit__(self, *exc) -> None:  # noqa: ANN002 - the context-manager protocol
        self._f.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._f.keys()

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self._f.get_tensor(key)
        self._log.append((key, t.nbytes))
        return t

    def get_slice(self, key: str) -> SpySlice:
        return SpySlice(self._f.get_slice(key), self._log, key)


def spy_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Patch moekit's `safe_open` for one test; returns the log that fills as data is read."""
    log: list[tuple[str, int]] = []
    real_open = ckpt_files.safe_open
    monkeypatch.setattr(ckpt_files, "safe_open", lambda *a, **kw: SpyFile(real_open(*a, **kw), log))
    return log

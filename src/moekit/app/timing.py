"""Timing one call: the single timer of `run`, `bench` and `tune`.

Data flow: a zero-argument callable -> warm-up calls (compilation, allocator, caches) -> `batches`
batches of `repeats` calls, each batch timed with CUDA events on a GPU (the device is asynchronous)
or the wall clock on a CPU -> the median seconds per call.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    fn: Callable[[], object], device: torch.device, *, repeats: int, batches: int = 7, warmup: int = 3
) -> float:
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    times = []
    for _ in range(batches):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3 / repeats)
        else:
            begin = time.perf_counter()
            for _ in range(repeats):
                fn()
            times.append((time.perf_counter() - begin) / repeats)
    return statistics.median(times)

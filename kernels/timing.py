"""Timing for the kernels' `benchmark` functions: the median of CUDA-event timings."""

from __future__ import annotations

import torch


def cuda_median_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` on the current CUDA stream (after `warmup` calls, which
    also compile Triton kernels)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]

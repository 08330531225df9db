"""Timing for the kernels' `benchmark` functions and the benchmarks: the median of CUDA-event
timings, the count of the kernels a call launches, and a table of them."""

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


def _profiled_kernels(fn, calls: int) -> list:
    """torch.profiler's (CUPTI's) averages of the kernels `calls` calls of `fn()` launch."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.self_device_time_total > 0]


def launches(fn, calls: int = 5) -> float:
    """Kernels a call of `fn()` (a graph's replay, an eager forward) launches."""
    return sum(e.count for e in _profiled_kernels(fn, calls)) / calls


def kernel_table(fn, top: int, calls: int = 5) -> None:
    """Print the `top` kernels of `fn()` (a graph's replay, an eager forward) by GPU time
    (torch.profiler, CUPTI): each with its launches and microseconds per call and its share
    of the call's kernel time."""
    kernels = _profiled_kernels(fn, calls)
    total = sum(e.self_device_time_total for e in kernels) or 1
    count = sum(e.count for e in kernels) / calls
    print(f"    {'kernel':<72} {'per call':>8} {'us':>9} {'share':>6}")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        us = e.self_device_time_total / calls
        print(f"    {e.key[:72]:<72} {e.count / calls:>8.0f} {us:>9.1f} {us * calls / total:>6.1%}")
    print(f"    (all kernels: {count:.0f} launches, {total / calls / 1e3:.2f} ms a call)")

"""Triton where it is installed, for every kernel file: `triton` and `tl` (None on CPU-only
installs, where each file's dispatcher runs its torch reference instead) and `jit`, which
compiles a kernel only where Triton can; `libdevice`, CUDA's math library (its functions
compile on CUDA only: Triton's interpreter has none).

`TRITON_INTERPRET=1` must be set before this module is first imported
(tests/kernels/conftest.py).
"""

from __future__ import annotations

import functools
import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ModuleNotFoundError:
    triton = tl = libdevice = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Programmatic dependent launch (compute capability 9 and later): a kernel launched with it
# is scheduled while the kernel before it in the stream is still running, and waits
# (`gdc_wait`, its first instruction) until that kernel's writes are visible, so a chain
# of small decode kernels loses the gap between one's end and the next one's start: a
# Qwen3-TTS frame at batch 1 4.65 -> 4.34 ms, Qwen3-Omni's thinker step 1.32 -> 1.29 ms at a
# quarter depth, on an H100 (docs/benchmarks-log.md, "First packets first, ...").


def jit(fn):
    """`triton.jit` where Triton is installed; without it the kernel is never launched."""
    return fn if triton is None else triton.jit(fn)


def on_triton(tensor) -> bool:
    """Whether a dispatcher runs its Triton kernel on `tensor`: on CUDA, and on the CPU under
    Triton's interpreter (`TRITON_INTERPRET=1`, set by the tests that run whole models'
    fused paths through the kernels there)."""
    return triton is not None and (tensor.is_cuda or _INTERPRETED)


@functools.cache
def _capability(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


def dependent_launch(tensor) -> dict:
    """A kernel's launch options over `tensor`'s device: its `GDC` constexpr (for
    `gdc_enter`) and, on a CUDA device of compute capability 9 or later, `launch_pdl`."""
    on = tensor.is_cuda and _capability(tensor.device.index or 0) >= 9
    return {"GDC": True, "launch_pdl": True} if on else {"GDC": False}


@jit
def gdc_enter(GDC: tl.constexpr):
    """A kernel's first statement: under a dependent launch, wait for the kernel before it,
    then let the next one be scheduled (it waits in turn for this one's writes)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

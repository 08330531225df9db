"""Triton where it is installed, for every kernel file: `triton` and `tl` (None on CPU-only
installs, where each file's dispatcher runs its torch reference instead) and `jit`, which
compiles a kernel only where Triton can; `libdevice`, CUDA's math library (its functions
compile on CUDA only: Triton's interpreter has none).

`TRITON_INTERPRET=1` must be set before this module is first imported
(tests/kernels/conftest.py).
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ModuleNotFoundError:
    triton = tl = libdevice = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def jit(fn):
    """`triton.jit` where Triton is installed; without it the kernel is never launched."""
    return fn if triton is None else triton.jit(fn)


def on_triton(tensor) -> bool:
    """Whether a dispatcher runs its Triton kernel on `tensor`: on CUDA, and on the CPU under
    Triton's interpreter (`TRITON_INTERPRET=1`, set by the tests that run whole models'
    fused paths through the kernels there)."""
    return triton is not None and (tensor.is_cuda or _INTERPRETED)

"""Triton where it is installed, for every kernel file: `triton` and `tl` (None on CPU-only
installs, where each file's dispatcher runs its torch reference instead) and `jit`, which
compiles a kernel only where Triton can.

`TRITON_INTERPRET=1` must be set before this module is first imported
(tests/kernels/conftest.py).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ModuleNotFoundError:
    triton = tl = None


def jit(fn):
    """`triton.jit` where Triton is installed; without it the kernel is never launched."""
    return fn if triton is None else triton.jit(fn)

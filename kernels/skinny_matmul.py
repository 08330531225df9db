"""Matrix products of a few rows by a weight, `x @ W.T` with `x` `[M, K]`, M <= ROWS: the
projections of an AR decode step (one row a request). A Triton kernel on CUDA, and the
torch reference (`reference`) it is tested against. Two variants ride on the same loop:

- gated: `W` is a SwiGLU MLP's merged gate/up matrix `[2 I, K]` (gate rows first) and the
  result is `silu(x @ Wg.T) * (x @ Wu.T)` `[M, I]`: the activation runs on the products
  in registers, so the MLP's `[M, 2 I]` intermediate is never written;
- split: the K axis is cut into `splits` slices, one program per (columns, slice), and the
  result is the float32 partial sums `[splits, M, N]`, which the next kernel adds up
  (`omniflow.kernels.rms_norm` takes them as its residual): enough programs to keep a
  weight with few output columns (a down or o projection) streaming from every SM,
  without a reduction kernel.

Why: at decode a projection reads its whole weight for a few rows, so it is bound by how
fast the weight streams. cuBLAS picks tiles for such shapes that moved the real-size
talker's MLP weights at 3.1 TB/s where a copy moves 4.15 on an H200, plus a memset and a
split-K reduction kernel per down projection and a separate SiLU x up kernel
(docs/benchmarks-log.md, "The talker's replay, kernel by kernel"); this kernel does each
projection in one launch: with the kernels around them, the talker's o, gate/up and down
products take 0.67x, 0.91x and 0.92x of cuBLAS' time, the thinker's gate/up 0.92x
(`benchmarks/skinny_matmul.py`; docs/benchmarks-log.md, "Skinny products"). Alone, cuBLAS
streams the thinker's q/k/v faster; chained to its neighbours by dependent launch the
kernel wins the whole step, and the decode step takes q/k/v here too.

Numerics: products accumulate in float32 (float32 inputs multiply in IEEE float32, as
torch does without TF32; off CUDA, under Triton's interpreter, which has no bfloat16
product, every input is upcast first: the products of bfloat16 values are exact in float32
either way); an unsplit result is rounded to the input dtype after the bias
is added in float32, as cuBLAS' epilogue does; the gated variant rounds the gate and up
products to the input dtype, then computes SiLU and the product as
`omniflow.kernels.silu_mul` does. Sums run in a different order than cuBLAS', so results
differ from `reference` by rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from omniflow.errors import OmniflowError
from omniflow.kernels import silu_mul
from omniflow.kernels.triton_guard import dependent_launch, gdc_enter, jit, tl, triton

# The most rows one call takes: the smallest tile side of Triton's tensor-core product.
ROWS = 16
# Programs per SM a split product aims for, so that enough weight bytes are in flight.
PROGRAMS_PER_SM = 4
# A program's output columns and its K tile: the defaults `--sweep` chose (docs/benchmarks-log.md).
BLOCK_N, BLOCK_K = 32, 128


class SkinnyMatmulError(OmniflowError):
    """Operands of mismatched shapes, or more rows than one call takes."""


@jit
def _skinny_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, tiles_per_split,
    x_stride, w_stride, out_split_stride, out_stride,
    HAS_BIAS: tl.constexpr, GATED: tl.constexpr, IN_FLOAT32: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr,
):  # fmt: skip
    gdc_enter(GDC)
    split = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = split * tiles_per_split * BLOCK_K + tl.arange(0, BLOCK_K)
    row_in, col_in = rows[:, None] < M, cols[:, None] < N
    x_ptrs = x_ptr + rows[:, None] * x_stride + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * w_stride + ks[None, :]
    up_offset = N.to(tl.int64) * w_stride
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for _ in range(tiles_per_split):
        k_in = ks[None, :] < K
        x = tl.load(x_ptrs, mask=row_in & k_in, other=0.0)
        w = tl.load(w_ptrs, mask=col_in & k_in, other=0.0)
        if IN_FLOAT32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IN_FLOAT32 else "tf32")
        if GATED:
            u = tl.load(w_ptrs + up_offset, mask=col_in & k_in, other=0.0)
            if IN_FLOAT32:
                u = u.to(tl.float32)
            up = tl.dot(x, tl.trans(u), up, input_precision="ieee" if IN_FLOAT32 else "tf32")
        ks += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    dtype = x_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * up.to(dtype).to(tl.float32)
    out = out_ptr + split * out_split_stride + rows[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_in & (cols[None, :] < N))


def _check(x: torch.Tensor, weight: torch.Tensor, bias, gated: bool) -> int:
    """The output width; raises on operands the kernel cannot take."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise SkinnyMatmulError(f"x {list(x.shape)} and weight {list(weight.shape)} do not chain")
    if x.dtype != weight.dtype:
        raise SkinnyMatmulError(f"x is {x.dtype}, the weight {weight.dtype}")
    if gated and (weight.shape[0] % 2 or bias is not None):
        raise SkinnyMatmulError(f"a gated weight is [2 I, K] without bias: {list(weight.shape)}")
    width = weight.shape[0] // 2 if gated else weight.shape[0]
    if bias is not None and bias.shape != (width,):
        raise SkinnyMatmulError(f"bias {list(bias.shape)} for {width} columns")
    return width


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2_between(n: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(n)))


def split_count(
    x: torch.Tensor, weight: torch.Tensor, most: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K
) -> int:
    """How many K slices, at most `most`, make enough programs to stream `weight`
    (PROGRAMS_PER_SM per SM on CUDA; 1 elsewhere, where the interpreter gains nothing)."""
    if not x.is_cuda:
        return 1
    column_blocks = triton.cdiv(weight.shape[0], block_n)
    tiles = triton.cdiv(weight.shape[1], block_k)
    wanted = triton.cdiv(PROGRAMS_PER_SM * _sm_count(x.device), column_blocks)
    return max(1, min(tiles, most, wanted))


def skinny_matmul_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
    splits: int = 1,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    num_stages: int = 4,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` `[M, N]` in x's dtype; gated: `[M, N / 2]` (see the module
    docstring); `splits` > 1: the float32 partial sums `[splits, M, N]` (bias in the first).
    The block sizes and pipeline depth are the kernel's tuning (benchmarks/skinny_matmul.py)."""
    width = _check(x, weight, bias, gated)
    rows, depth = x.shape
    if rows > ROWS:
        raise SkinnyMatmulError(f"{rows} rows: at most {ROWS} a call")
    if gated and splits != 1:
        raise SkinnyMatmulError("a gated product needs its whole K: splits must be 1")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise SkinnyMatmulError("x's and the weight's rows must be contiguous")
    block_n = _pow2_between(width, 16, block_n)
    block_k = _pow2_between(depth, 16, block_k)
    tiles = triton.cdiv(depth, block_k)
    tiles_per_split = triton.cdiv(tiles, splits)
    splits = triton.cdiv(tiles, tiles_per_split)  # no empty slice
    if splits > 1:
        out = torch.empty(splits, rows, width, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(width, block_n), splits)
        _skinny_matmul_kernel[grid](
            x, weight, weight if bias is None else bias, out, rows, width, depth,
            tiles_per_split, x.stride(0), weight.stride(0),
            out.stride(0) if splits > 1 else 0, out.stride(-2),
            HAS_BIAS=bias is not None, GATED=gated,
            IN_FLOAT32=x.dtype == torch.float32 or not x.is_cuda,
            ROWS=ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=num_stages,
            **dependent_launch(x),
        )  # fmt: skip
    return out


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> torch.Tensor:
    """The product as torch computes it: `F.linear`, then `silu(gate) * up` when gated."""
    _check(x, weight, bias, gated)
    product = F.linear(x, weight, bias)
    return silu_mul.reference(product) if gated else product

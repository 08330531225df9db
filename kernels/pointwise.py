"""Fused pointwise map chains: one generated Triton kernel per chain, and a torch reference.

A chain such as `gain(0.9) | clamp(-1, 1) | pcm16` becomes a single expression over `x`
(ops from `pointwise_ops.OPS`, arguments inlined as constants). On a CUDA tensor it runs
as one Triton kernel (one read, one write per element); elsewhere torch evaluates the same
expression. `reference` applies the ops one at a time, as an unfused pipeline would.
Generated kernels are written to a cache directory because Triton compiles from source files.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
from functools import cache
from pathlib import Path

import torch

from omniflow.kernels.pointwise_ops import OPS, chain_out_dtype

Chain = tuple[tuple[str, tuple], ...]
_PRIMITIVES = ("exp", "floor", "minimum", "maximum", "abs")
BLOCK = 1024


def _torch_min(a, b):
    return torch.clamp(a, max=b) if not torch.is_tensor(b) else torch.minimum(a, b)


def _torch_max(a, b):
    return torch.clamp(a, min=b) if not torch.is_tensor(b) else torch.maximum(a, b)


_TORCH_NS = {
    "exp": torch.exp,
    "floor": torch.floor,
    "abs": torch.abs,
    "minimum": _torch_min,
    "maximum": _torch_max,
}


class _Inline(ast.NodeTransformer):
    """Substitute `x` by the previous op's expression and argument names by constants."""

    def __init__(self, x: ast.expr, args: dict[str, float], prefix: str):
        self.x, self.args, self.prefix = x, args, prefix

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id == "x":
            return self.x
        if node.id in self.args:
            return ast.Constant(float(self.args[node.id]))
        if node.id in _PRIMITIVES and self.prefix:
            return ast.Attribute(ast.Name(self.prefix, ast.Load()), node.id, ast.Load())
        return node


def chain_expression(chain: Chain, prefix: str = "") -> str:
    """The whole chain as one expression over `x` (primitives qualified by `prefix`, e.g. "tl")."""
    expr: ast.expr = ast.Name("x", ast.Load())
    for name, args in chain:
        op = OPS[name]
        tree = ast.parse(op.expr, mode="eval").body
        expr = _Inline(expr, dict(zip(op.args, args, strict=True)), prefix).visit(tree)
    return ast.unparse(ast.fix_missing_locations(expr))


@cache
def _torch_code(chain: Chain):
    """The chain's expression compiled once: a served output edge maps every chunk."""
    return compile(chain_expression(chain), "<pointwise chain>", "eval")


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def reference(x: torch.Tensor, chain: Chain) -> torch.Tensor:
    """Unfused: one torch evaluation (and temporary) per op, in float32, cast at the end."""
    y = x.to(torch.float32)
    for name, args in chain:
        y = eval(chain_expression(((name, args),)), _TORCH_NS, {"x": y})  # noqa: S307 (expressions are ours)
    return y.to(_torch_dtype(chain_out_dtype(_dtype_name(x), list(chain))))


def _dtype_name(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


def triton_source(chain: Chain, out_dtype: str) -> str:
    return f"""import triton
import triton.language as tl


@triton.jit
def fused_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = {chain_expression(chain, "tl")}
    tl.store(y_ptr + offs, y.to(tl.{out_dtype}), mask=mask)
"""


@cache
def _compiled(chain: Chain, out_dtype: str):
    source = triton_source(chain, out_dtype)
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    root = Path(os.environ.get("OMNIFLOW_CACHE", Path.home() / ".cache" / "omniflow")) / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"fused_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    spec = importlib.util.spec_from_file_location(f"omniflow_fused_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fused_kernel


def triton_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def fused(x: torch.Tensor, chain: Chain) -> torch.Tensor:
    """Apply the whole chain in one pass: a generated Triton kernel on CUDA, torch elsewhere."""
    out_dtype = chain_out_dtype(_dtype_name(x), list(chain))
    if not (x.is_cuda and triton_available()):
        y = eval(_torch_code(chain), _TORCH_NS, {"x": x.to(torch.float32)})  # noqa: S307
        return y.to(_torch_dtype(out_dtype))
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=_torch_dtype(out_dtype), device=x.device)
    n = x.numel()
    if n:
        _compiled(chain, out_dtype)[(-(-n // BLOCK),)](x, y, n, BLOCK=BLOCK)
    return y

"""The pointwise ops a `map(...)` chain may use: name, arguments, expression, result dtype.

Each op's expression is written over `x` with a handful of primitives (`exp`, `floor`,
`minimum`, `maximum`, `abs`) that both the torch reference and the generated Triton
kernel provide, so the two compute the same thing by construction. Importing this file is
cheap (no torch): the compiler checks programs against it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PointwiseOp:
    args: tuple[str, ...]
    expr: str  # over `x` and the argument names; evaluated in float32
    out_dtype: str | None = None  # None keeps float32 within the chain
    doc: str = ""
    ordered: tuple[str, ...] = ()  # arguments a program must give in non-decreasing order


OPS: dict[str, PointwiseOp] = {
    "gain": PointwiseOp(("k",), "x * k", doc="multiply by k"),
    "offset": PointwiseOp(("b",), "x + b", doc="add b"),
    "clamp": PointwiseOp(
        ("lo", "hi"), "minimum(maximum(x, lo), hi)", doc="clip to [lo, hi]", ordered=("lo", "hi")
    ),
    "abs": PointwiseOp((), "abs(x)", doc="absolute value"),
    "relu": PointwiseOp((), "maximum(x, 0.0)", doc="max(x, 0)"),
    "sigmoid": PointwiseOp((), "1.0 / (1.0 + exp(-x))", doc="logistic function"),
    "tanh": PointwiseOp((), "2.0 / (1.0 + exp(-2.0 * x)) - 1.0", doc="hyperbolic tangent"),
    "denorm": PointwiseOp((), "(x + 1.0) * 0.5", doc="[-1, 1] -> [0, 1]"),
    "pcm16": PointwiseOp(
        (),
        "floor(minimum(maximum(x, -1.0), 1.0) * 32767.0 + 0.5)",
        "int16",
        doc="float audio in [-1, 1] -> 16-bit PCM",
    ),
    "to_uint8": PointwiseOp(
        (),
        "floor(minimum(maximum(x, 0.0), 1.0) * 255.0 + 0.5)",
        "uint8",
        doc="[0, 1] -> 8-bit pixels",
    ),
}


def chain_out_dtype(in_dtype: str, ops: list[tuple[str, tuple]]) -> str:
    """dtype of a chain's result: the last op that fixes a dtype wins, else the input's."""
    out = in_dtype
    for name, _ in ops:
        out = OPS[name].out_dtype or ("float32" if out in ("int16", "uint8") else out)
    return out

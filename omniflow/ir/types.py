"""Port types and tensor specs: what travels along an edge and how big one item is.

An item is what one request sends per step on a port (one token, one codec frame, one
image). Shapes may hold symbolic dims (strings) until the passes make them concrete.
"""

from __future__ import annotations

from dataclasses import dataclass

from omniflow.dtypes import dtype_bytes

PORT_TYPES: tuple[str, ...] = (
    "text",
    "chat",
    "tokens",
    "hidden",
    "codes",
    "latents",
    "image",
    "audio",
    "video",
    "kv",
)

# Port types carried as tensors; text and chat travel as UTF-8 bytes.
TENSOR_TYPES = frozenset(PORT_TYPES) - {"text", "chat"}


@dataclass(frozen=True)
class TensorSpec:
    """dtype and per-item shape of a port (`utf8` for text); dims may be symbolic strings."""

    dtype: str
    shape: tuple[int | str, ...]

    def item_bytes(self) -> int:
        """Bytes of one item; symbolic dims must have been made concrete first."""
        n = 1
        for d in self.shape:
            if not isinstance(d, int):
                raise ValueError(f"shape {self.shape} has a symbolic dim {d!r}")
            n *= d
        return n * (1 if self.dtype == "utf8" else dtype_bytes(self.dtype))

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

"""Element types by name: the one table of the dtypes omniflow plans with.

The compiler sizes tensors from these names without importing torch (`dtype_bytes`); the
backends and the data plane turn a name into a torch dtype and back (`torch_dtype`,
`dtype_name`). Names are torch's (`bfloat16`, `float8_e4m3fn`); common spellings from
model configs (`bf16`, `torch.float16`, `half`) are accepted as aliases.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
ALIASES: dict[str, str] = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp8": "float8_e4m3fn",
    "float8": "float8_e4m3fn",
}
# What a stage may compute in (its `dtype=` choices, and a checkpoint's stated dtype).
STAGE_DTYPES = ("bfloat16", "float16", "float32")


def canonical_dtype(name: str) -> str | None:
    """The table's name for `name` (an alias or `torch.`-prefixed spelling), or None."""
    name = name.removeprefix("torch.")
    name = ALIASES.get(name, name)
    return name if name in DTYPE_BYTES else None


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name; ValueError naming the known ones if unknown."""
    canonical = canonical_dtype(name)
    if canonical is None:
        raise _unknown(name)
    return DTYPE_BYTES[canonical]


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name: the table's, an alias, or any other torch dtype's name."""
    import torch

    found = getattr(torch, canonical_dtype(name) or name.removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise _unknown(name)
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name, as `torch_dtype` takes it back."""
    return str(dtype).removeprefix("torch.")


# A rotary embedding's frequencies (transformers' `inv_freq` and the copy dynamic RoPE
# restores): buffers that `from_pretrained` keeps float32 whatever the weights' dtype.
ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def cast_model(module: torch.nn.Module, dtype: torch.dtype, device=None) -> torch.nn.Module:
    """`module.to(device, dtype)` with its rotary frequencies kept float32, as transformers'
    `from_pretrained` keeps them: cast to bf16 each is off by up to 0.4 %, so a token's angle
    at position p is off by p times that (over half a radian by position 500 at a head width
    of 128: tests/test_dtypes.py)."""
    kept = {
        name: buffer
        for name, buffer in module.named_buffers()
        if name.rpartition(".")[2] in ROTARY_BUFFERS
    }
    module.to(device=device, dtype=dtype)
    for name, buffer in kept.items():
        owner, _, attribute = name.rpartition(".")
        target = module.get_submodule(owner)
        setattr(target, attribute, buffer.to(device=getattr(target, attribute).device))
    return module


def _unknown(name: str) -> ValueError:
    return ValueError(f"unknown dtype '{name}' (known: {', '.join(DTYPE_BYTES)})")

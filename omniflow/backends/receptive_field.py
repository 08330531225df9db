"""Receptive fields from an architecture: where one input frame's influence lies, layer by layer.

Interval arithmetic over 1-d sequence layers, in exact integers. A `Field` is the inclusive
interval of a layer's positions that input frame 0 can influence; each function here maps it
through one kind of layer (convolution, transposed convolution, shift, summed branches,
causal attention, recurrence). A decoder walks its real modules in forward order with these
(vocoders.py), so its reach follows from the loaded architecture. Measuring it instead (change
a frame, see which samples change) depends on rounding: at a field's edges the influence
passes through filter tails small enough that whether it survives float32 summation differs
from one CPU to another.

Positions are those of an unbounded input, so padding and trimming at the ends of a real one
only shift them. Elementwise layers leave a field as it is and need no function here.
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from omniflow.errors import OmniflowError


class ReceptiveFieldError(OmniflowError):
    """A layer's positions do not line up with whole input frames."""


@dataclasses.dataclass(frozen=True)
class Field:
    """Positions `first..last` (inclusive; +-math.inf: unbounded) of some layer that input
    frame 0 influences, at `per_frame` positions of that layer per input frame.

    `min_frames`: the fewest input frames for which every layer passed so far treats an input
    as it treats longer ones (a reflect padding longer than its input pads differently).
    """

    first: float
    last: float
    per_frame: int = 1
    min_frames: int = 1


def _floor_div(value: float, divisor: int) -> float:
    return value if math.isinf(value) else value // divisor


def _ceil_div(value: float, divisor: int) -> float:
    return value if math.isinf(value) else -(-value // divisor)


def conv(field: Field, kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1) -> Field:
    """Through a convolution: output o reads inputs o*stride - padding + i*dilation, i < kernel."""
    if field.per_frame % stride:
        raise ReceptiveFieldError(
            f"a stride-{stride} convolution over {field.per_frame} positions per frame "
            "does not keep frames whole"
        )
    return dataclasses.replace(
        field,
        first=_ceil_div(field.first + padding - (kernel - 1) * dilation, stride),
        last=_floor_div(field.last + padding, stride),
        per_frame=field.per_frame // stride,
    )


def conv_transpose(
    field: Field, kernel: int, stride: int = 1, padding: int = 0, dilation: int = 1
) -> Field:
    """Through a transposed convolution: input q writes outputs
    q*stride - padding + i*dilation, i < kernel."""
    return dataclasses.replace(
        field,
        first=field.first * stride - padding,
        last=field.last * stride - padding + (kernel - 1) * dilation,
        per_frame=field.per_frame * stride,
    )


def shift(field: Field, positions: int) -> Field:
    """Padding `positions` on the left (trimming, if negative)."""
    return dataclasses.replace(field, first=field.first + positions, last=field.last + positions)


def union(*branches: Field) -> Field:
    """Branches over the same positions whose outputs are summed (a residual's identity is one)."""
    return dataclasses.replace(
        branches[0],
        first=min(b.first for b in branches),
        last=max(b.last for b in branches),
        min_frames=max(b.min_frames for b in branches),
    )


def causal_attention(field: Field, window: int | None) -> Field:
    """Through attention in which a position sees itself and the `window - 1` before it (all
    before it if `window` is None)."""
    return dataclasses.replace(field, last=math.inf if window is None else field.last + window - 1)


def recurrent(field: Field) -> Field:
    """Through a recurrence that runs forward: every later position remembers the frame."""
    return dataclasses.replace(field, last=math.inf)


def needs_more_than(field: Field, positions: int) -> Field:
    """Before a layer that pads inputs of at most `positions` positions differently. Its input
    is taken to be `per_frame` positions per input frame: true of decoders whose every layer
    keeps its length a whole multiple of the input's, as their transposed convolutions trim."""
    return dataclasses.replace(
        field, min_frames=max(field.min_frames, positions // field.per_frame + 1)
    )


def conv1d(field: Field, module: nn.Conv1d) -> Field:
    return conv(
        field, module.kernel_size[0], module.stride[0], module.padding[0], module.dilation[0]
    )


def conv_transpose1d(field: Field, module: nn.ConvTranspose1d) -> Field:
    return conv_transpose(
        field, module.kernel_size[0], module.stride[0], module.padding[0], module.dilation[0]
    )


def lookahead(field: Field) -> float:
    """Input frames after an output frame that its positions depend on."""
    return max(0, -_floor_div(field.first, field.per_frame))


def context(field: Field) -> float:
    """Input frames before an output frame that its positions depend on."""
    return max(0, _floor_div(field.last, field.per_frame))

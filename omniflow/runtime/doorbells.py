"""Typed messages of the data plane: what a channel's doorbell carries.

A producer rings the consumer with a `Doorbell` (which slot, the caller's `ChunkMeta`, and a
`TensorHeader` per tensor); the consumer hands the slot back with a `Credit`. All are
msgspec Structs encoded as msgpack arrays, so a doorbell is a few dozen bytes and never
involves pickle.
"""

from __future__ import annotations

import msgspec


class Ending(msgspec.Struct, frozen=True, array_like=True):
    """Why a stage ended a request's outputs and what the request cost it, sent with the end
    of each of its output streams: `reason` ("stop": an end or stop token or a stop string;
    "length": its token limit), the prompt's tokens, the tokens it generated, and where the
    stage puts media into its prompt, the prompt's placeholder tokens of each media kind it
    takes (`{"audio": n, "image": n, "video": n}`, part of `prompt_tokens`)."""

    reason: str
    prompt_tokens: int = 0
    tokens: int = 0
    media: dict[str, int] = {}


class ChunkMeta(msgspec.Struct, frozen=True, array_like=True):
    """What the caller says about one chunk: its request, its index, whether it ends the
    stream, when it was handed to the channel (monotonic ns, one clock per host), and with
    the end, the producing stage's `Ending` if it gave one."""

    request_id: str
    chunk: int = 0
    end: bool = False
    sent: int = 0
    ending: Ending | None = None


class TensorHeader(msgspec.Struct, frozen=True, array_like=True):
    """One tensor in a slot: dtype name (`torch.<dtype>` without the prefix), shape, byte offset."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


class Doorbell(msgspec.Struct, frozen=True, array_like=True):
    """Producer -> consumer: slot `slot` holds these tensors for this chunk."""

    slot: int
    meta: ChunkMeta
    tensors: tuple[TensorHeader, ...]


class Credit(msgspec.Struct, frozen=True, array_like=True):
    """Consumer -> producer: slot `slot` is free again."""

    slot: int

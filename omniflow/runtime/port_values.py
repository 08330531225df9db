"""Port values on the wire: every value travels as one tensor, and steps concatenate.

A tensor port's chunk is a tensor whose first dim counts steps (n steps x item shape).
Text is a str and travels as its UTF-8 bytes; chat (a list of messages) as UTF-8 JSON.
An image port's value may also be a str, the path of an image file the stage reads: it
travels as its UTF-8 bytes, a 1-D uint8 tensor, which no image is (images are `[H, W, 3]`).

A media port's value (image, audio, video) may be a list of items, several parts of one
request (two images of one chat): it travels as one 1-D uint8 tensor, a magic prefix, a
JSON header (each item's dtype and shape, or its path) and the items' bytes (`pack_items`),
and arrives as the list again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

TEXT_TYPES = ("text", "chat")
MEDIA_TYPES = ("image", "audio", "video")
# What a packed list of media items starts with: no UTF-8 path or media file starts so.
_LIST_MAGIC = b"\x00omniflow-items\x00"


def encode(port_type: str, value) -> torch.Tensor:
    """A port value as one tensor (text and image paths as uint8 UTF-8 bytes); a tensor is
    one already (a value admission encoded)."""
    if isinstance(value, torch.Tensor):
        return value
    if port_type in MEDIA_TYPES and isinstance(value, list):
        return pack_items(value)
    if port_type == "text" or (port_type == "image" and isinstance(value, str)):
        return _bytes(value.encode("utf-8"))
    if port_type == "chat":
        return _bytes(json.dumps(value).encode("utf-8"))
    return value


def _bytes(data: bytes) -> torch.Tensor:
    # frombuffer refuses an empty buffer; the empty text is a value all the same.
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode(port_type: str, tensor: torch.Tensor):
    """The inverse of `encode`; tensors come back as they are (callers copy if they keep them)."""
    if port_type == "text":
        return bytes(tensor.numpy()).decode("utf-8")
    if port_type in MEDIA_TYPES and is_packed(tensor):
        return unpack_items(tensor)
    if port_type == "image" and tensor.dim() == 1 and tensor.dtype == torch.uint8:
        # Not strict: a malformed image sent as 1-D bytes becomes a path the stage cannot
        # open, which fails that request there, not the process that decodes it.
        return bytes(tensor.numpy()).decode("utf-8", errors="replace")
    if port_type == "chat":
        return json.loads(bytes(tensor.numpy()).decode("utf-8"))
    return tensor


def concat(port_type: str, chunks: list):
    """Join chunks of one stream in order (text by concatenation, tensors along dim 0)."""
    if port_type in TEXT_TYPES:
        return "".join(chunks) if port_type == "text" else chunks[-1]
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat(chunks)


@dataclass(frozen=True)
class Ahead:
    """Steps a stage emits before a stream's own and that are no part of it (`Call.emit`'s
    `ahead`): a voice clone's reference frames, which its vocoder decodes as context and
    does not play. The edge's writer sends them at once, outside its chunk schedule, and
    the stage's count of the steps it made (its `num_tokens_out`, its profile's) leaves them
    out."""

    value: object


def steps(port_type: str, value) -> int:
    """How many steps a chunk holds (a text chunk, or an image given as a path, counts as one)."""
    if port_type in TEXT_TYPES or not isinstance(value, torch.Tensor) or not value.dim():
        return 1
    return int(value.shape[0])


def nbytes(value) -> int:
    """The bytes a chunk carries (text as UTF-8; 0 for None)."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        return value.nbytes
    return len(str(value).encode("utf-8"))


def is_packed(tensor) -> bool:
    """Whether a tensor is a packed list of media items (`pack_items`)."""
    n = len(_LIST_MAGIC)
    return (
        isinstance(tensor, torch.Tensor)
        and tensor.dim() == 1
        and tensor.dtype == torch.uint8
        and tensor.numel() >= n
        and bytes(tensor[:n].numpy()) == _LIST_MAGIC
    )


def pack_items(items: list) -> torch.Tensor:
    """A list of media items (tensors, or str paths) as one 1-D uint8 tensor."""
    header, blobs = [], []
    for item in items:
        if isinstance(item, str):
            header.append({"path": item})
            continue
        tensor = torch.as_tensor(item).contiguous().cpu()
        header.append(
            {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        )
        blobs.append(
            tensor.reshape(-1).view(torch.uint8)
            if tensor.numel()
            else tensor.new_empty(0).view(torch.uint8)
        )
    head = json.dumps(header).encode("utf-8")
    parts = [_bytes(_LIST_MAGIC + len(head).to_bytes(4, "little") + head), *blobs]
    return torch.cat(parts)


def unpack_items(tensor: torch.Tensor) -> list:
    """`pack_items`' inverse: the list of items (tensors copied out, paths as str)."""
    data = tensor.numpy().tobytes()
    at = len(_LIST_MAGIC)
    size = int.from_bytes(data[at : at + 4], "little")
    header = json.loads(data[at + 4 : at + 4 + size].decode("utf-8"))
    at += 4 + size
    items = []
    for entry in header:
        if "path" in entry:
            items.append(entry["path"])
            continue
        dtype = getattr(torch, entry["dtype"])
        shape = entry["shape"]
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty(0, dtype=dtype).element_size()
        chunk = bytearray(data[at : at + nbytes])
        at += nbytes
        flat = torch.frombuffer(chunk, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        items.append(flat.reshape(shape))
    return items

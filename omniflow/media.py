"""Turning pipeline outputs into files people can open: WAV audio and PNG images."""

from __future__ import annotations

import io
import struct
import wave
import zlib

import torch


def pcm16(audio: torch.Tensor) -> torch.Tensor:
    """Any audio output as flat int16 samples (float audio in [-1, 1] is scaled)."""
    flat = audio.reshape(-1)
    if flat.dtype == torch.int16:
        return flat
    return torch.floor(flat.float().clamp(-1, 1) * 32767 + 0.5).to(torch.int16)


def wav_bytes(audio: torch.Tensor, rate: int) -> bytes:
    """A mono 16-bit WAV file of `audio`."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm16(audio).numpy().tobytes())
    return buffer.getvalue()


def png_bytes(image: torch.Tensor) -> bytes:
    """A PNG of an [H, W, 3] uint8 image (leading singleton dims are dropped)."""
    pixels = image.reshape(image.shape[-3:]).to(torch.uint8).contiguous()
    height, width, _ = pixels.shape
    rows = b"".join(b"\x00" + pixels[y].numpy().tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )

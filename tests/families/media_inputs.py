"""The media the omni families' tests send: images, clips and video frames made from seeds,
user turns that place them, the five chats every omni thinker is held to `generate` on,
and the data: URIs a served test puts them in."""

from __future__ import annotations

import base64
import io
import math

import torch

SAMPLE_RATE = 16000  # what the omni towers hear


def image(seed: int, h: int, w: int) -> torch.Tensor:
    return torch.randint(0, 256, (h, w, 3), generator=torch.Generator().manual_seed(seed)).to(
        torch.uint8
    )


def audio(seconds: float, hz: float) -> torch.Tensor:
    t = torch.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.4 * torch.sin(2 * math.pi * hz * t)).float()


def frames(count: int) -> torch.Tensor:
    return torch.stack([image(100 + i, 60, 80) for i in range(count)])


def user(*parts, text="What is in there?"):
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def cases(unit: int) -> dict:
    """name -> (chat, media inputs, parameters): an image; a clip; a 4-frame video; two images
    of different grids and a clip in one message; a 6-frame video with its 3 s audio track.
    `unit`: the pixels one merged patch covers (patch x merge), which the images' sides are
    multiples of."""
    return {
        "image": (user({"type": "image"}), {"image": image(0, 2 * unit, 3 * unit)}, {}),
        "audio": (user({"type": "audio"}), {"input_audio": audio(1.5, 440.0)}, {}),
        "video": (user({"type": "video"}), {"video": frames(4)}, {}),
        "two images and audio": (
            user({"type": "image"}, {"type": "audio"}, {"type": "image"}),
            {
                "image": [image(1, 2 * unit, 2 * unit), image(2, 3 * unit, 2 * unit)],
                "input_audio": audio(0.7, 300.0),
            },
            {},
        ),
        "video with its audio": (
            user({"type": "video"}),
            {"video": frames(6), "input_audio": audio(3.0, 220.0)},
            {"use_audio_in_video": True},
        ),
    }


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png(pixels: torch.Tensor) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()

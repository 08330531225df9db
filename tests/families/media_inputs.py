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


# --- what the omni processors do, for the references ------------------------------------------


def vision_inputs(listed: dict, images, settings: dict, video_patches) -> tuple[dict, dict]:
    """The model inputs of the listed images (by the image processor `images`) and videos (at
    the video `settings`, by the towers' `video_patches`), as an omni processor gives them,
    and each item's token count (merged 2 x 2): (kwargs, counts)."""
    kwargs, counts = {}, {"image": [], "video": [], "audio": []}
    if "image" in listed:
        out = images(images=[i.numpy() for i in listed["image"]], return_tensors="pt")
        kwargs |= {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        counts["image"] = (out["image_grid_thw"].prod(-1) // 4).tolist()
    if "video" in listed:
        patches = [video_patches(v, images, settings, 2, 2) for v in listed["video"]]
        grid = torch.stack([g for _, g in patches])
        kwargs |= {
            "pixel_values_videos": torch.cat([p for p, _ in patches]),
            "video_grid_thw": grid,
            "video_second_per_grid": torch.tensor([2 / settings["fps"]] * len(grid)),
        }
        counts["video"] = (grid.prod(-1) // 4).tolist()
    return kwargs, counts


def interleaver(processor_class, processor, kwargs: dict, counts: dict, **options):
    """An `interleave` for `expanded_ids`: the omni `processor_class`'s own
    `replace_video_with_audio_token` on a stand-in `processor` (its tokens), with the
    videos' grids of `kwargs`, the clips' token `counts` and `options` (positions a second,
    ...)."""

    def interleave(video: int, audio: int) -> str:
        return processor_class.replace_video_with_audio_token(
            processor,
            {
                "video_grid_thw": kwargs["video_grid_thw"],
                "video_second_per_grid": kwargs["video_second_per_grid"].tolist(),
            },
            video,
            {"num_audio_tokens": counts["audio"]},
            audio,
            **options,
        )

    return interleave


def expanded_ids(tokenizer, messages, placeholders: dict, counts: dict, interleave=None):
    """The chat's input ids `[1, L]` with each media placeholder (`placeholders`: kind ->
    token) repeated once per token of its item (`counts`), as an omni processor expands
    them; with `interleave` (`use_audio_in_video`), a video's text is
    `interleave(video index, audio index)`: its tokens and its audio track's, the next
    audio item."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    for kind, token in placeholders.items():
        text = text.replace(token, f"\0{kind}\0")
    pieces, taken = text.split("\0"), dict.fromkeys(placeholders, 0)
    for i, piece in enumerate(pieces):
        if piece not in placeholders:
            continue
        if piece == "video" and interleave is not None:
            pieces[i] = interleave(taken["video"], taken["audio"])
            taken["audio"] += 1
        else:
            pieces[i] = placeholders[piece] * counts[piece][taken[piece]]
        taken[piece] += 1
    return tokenizer("".join(pieces), return_tensors="pt").input_ids

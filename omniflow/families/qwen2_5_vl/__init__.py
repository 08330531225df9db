"""Qwen2.5-VL (`model_type` qwen2_5_vl): a vision tower whose patch embeddings, with their
grid, feed a language model with multimodal RoPE.

Run-time half: `vision_tower` (the tower for the transformers `encoder` backend),
`language_model` (the LM on image embeddings for the transformers `ar` backend);
`checkpoints` (tiny, reference).
"""

from __future__ import annotations

from omniflow.families.family import Family, Part, TinyModel

_HERE = __name__
# Qwen2-VL's image processor (its `smart_resize`, which Qwen2.5-VL's, Qwen2.5-Omni's and
# Qwen3-Omni's processors share, for images and video frames) refuses a picture whose long
# side is more than this many times its short one.
MAX_ASPECT_RATIO = 200


def image_admission(stage, path: str):
    """`Family.admission` of a stage that sees pictures through that processor (a vision
    tower, `component="visual"`): each image's and video's aspect ratio at most
    MAX_ASPECT_RATIO, a 400 at admission rather than the processor's refusal in the stage."""
    if stage.kind != "encoder" or stage.component != "visual":
        return None
    return check_aspect_ratios


def check_aspect_ratios(params: dict, inputs: dict) -> None:
    """A stage's pictures (any input port's images and videos) checked against the
    processor's MAX_ASPECT_RATIO: a StageRequestError naming the port."""
    from omniflow.runtime.requests import StageRequestError

    for port, value in inputs.items():
        for picture in value if isinstance(value, list) else [value]:
            size = _picture_size(picture)
            if size is not None and max(size) > MAX_ASPECT_RATIO * min(size):
                raise StageRequestError(
                    f"input '{port}': a picture of {size[0]} x {size[1]} pixels; this "
                    f"model's image processor takes aspect ratios up to {MAX_ASPECT_RATIO}:1",
                    port,
                )


def _picture_size(picture) -> tuple[int, int] | None:
    """(width, height) of an image `[H, W, C]`, decoded video frames `[T, H, W, C]` or a
    video file's bytes (uint8 `[N]`, as chat passes it on: its header's), else None."""
    import torch

    from omniflow import media

    shape = getattr(picture, "shape", ())
    if len(shape) in (3, 4):
        return shape[-2], shape[-3]
    if len(shape) == 1 and picture.dtype == torch.uint8:
        try:
            info = media.video_header(picture.numpy().tobytes())
        except media.MediaError:  # (what reads no header is the stage's to refuse)
            return None
        return info.width, info.height
    return None


FAMILY = Family(
    name="qwen2_5_vl",
    doc=__doc__,
    architectures=("qwen2_5_vl",),
    parts={
        "visual": Part("vision_encoder", ("vision_config",), weights=("visual.", "model.visual.")),
        "language_model": Part("decoder_lm", ("text_config?",), class_level=0),
    },
    admission=f"{_HERE}:image_admission",
    runtime={
        ("ar", "transformers"): f"{_HERE}.language_model:load",
        ("encoder", "transformers"): f"{_HERE}.vision_tower:load",
    },
    tiny=(
        TinyModel(
            "qwen2.5-vl",
            "Qwen2_5_VLForConditionalGeneration: vision tower (2 blocks, 14 px patches) and "
            "a 2-layer, 64-wide decoder with multimodal RoPE, with its image processor",
            ("tokenizer", "model", "save"),
            f"{_HERE}.checkpoints:build_tiny",
            counterparts=("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct"),
        ),
    ),
)

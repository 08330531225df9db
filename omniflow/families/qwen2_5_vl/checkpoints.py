"""Qwen2.5-VL's checkpoints: the tiny one of the real architecture (vision tower of 2
blocks with real 14 px patching, a 2-layer 64-wide decoder with multimodal RoPE, its image
processor), and the unsplit reference run, the model's own `generate` on one image.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from omniflow.checkpoints.tiny_recipes import (
    MROPE,
    TEXT_DIMS,
    VISION_DIMS,
    chat_lm,
    round_up,
    seed_weights,
    special_ids,
)
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer
from omniflow.hf_logging import quiet

# Qwen2.5-VL's published preprocessor_config.json: images are resized to between 4 and
# 16384 merged 28 x 28 patches.
VL_MIN_PIXELS = 56 * 56
VL_MAX_PIXELS = 28 * 28 * 16384


def qwen_vl_config(tokenizer, **text: Any):
    """A tiny Qwen2_5_VLConfig over the qwen tokenizer; `text` adds text-config keys."""
    from transformers import Qwen2_5_VLConfig

    ids = special_ids(tokenizer)
    return Qwen2_5_VLConfig(
        text_config={
            **TEXT_DIMS,
            "vocab_size": round_up(len(tokenizer), 64),
            "rope_parameters": MROPE,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            **text,
        },
        vision_config={**VISION_DIMS, "out_hidden_size": TEXT_DIMS["hidden_size"]},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def build_tiny(out: Path) -> Iterator[str]:
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    ids = special_ids(tokenizer)
    tokenizer.save_pretrained(out)
    # The PIL image processor saves as `Qwen2VLImageProcessor`, as the real checkpoint's
    # does; the processor that would bundle it with the tokenizer needs torchvision.
    Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS).save_pretrained(
        out
    )

    yield "model"
    config = qwen_vl_config(tokenizer, bos_token_id=ids["<|endoftext|>"])
    model = chat_lm(
        seed_weights(Qwen2_5_VLForConditionalGeneration(config), "qwen2.5-vl"), tokenizer
    )

    yield "save"
    model.save_pretrained(out)


# --- the unsplit reference ---


class VLReference(NamedTuple):
    """What `reference_vl_generate` returns: the generated ids (prompt excluded), (n,)
    int64, the image's patch grid `image_grid_thw` (1, 3), and the ids decoded."""

    text_ids: torch.Tensor
    image_grid_thw: torch.Tensor
    text: str


@torch.no_grad()
def reference_vl_generate(
    model_dir: str | Path, prompt_text: str, image, max_new_tokens: int = 16
) -> VLReference:
    """Qwen2.5-VL's own `generate` on one image and one user turn, greedy.

    `image` is what the image processor takes (a PIL image, a uint8 [H, W, 3] array or
    tensor) or a path, opened with PIL as RGB. The inputs are what `Qwen2_5_VLProcessor`
    makes, which cannot be constructed without torchvision: the image processor's pixel
    patches and grid; the chat template on `[image, text]`, its `<|image_pad|>` repeated
    once per merged patch; `mm_token_type_ids` 1 on those tokens, 0 elsewhere.
    """
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    with quiet():
        processor = AutoImageProcessor.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    if isinstance(image, (str, Path)):
        with Image.open(image) as opened:
            image = opened.convert("RGB")
    elif isinstance(image, torch.Tensor):
        image = image.numpy()
    pixels = processor(images=[image], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt_text}]}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    placeholder = tokenizer.convert_ids_to_tokens(model.config.image_token_id)
    tokens = int(grid.prod()) // processor.merge_size**2
    inputs = tokenizer(text.replace(placeholder, placeholder * tokens), return_tensors="pt")
    with quiet():
        sequences = model.generate(
            **inputs,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=grid,
            mm_token_type_ids=(inputs.input_ids == model.config.image_token_id).int(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    text_ids = sequences[0, inputs.input_ids.shape[1] :]
    return VLReference(text_ids, grid, tokenizer.decode(text_ids, skip_special_tokens=True))

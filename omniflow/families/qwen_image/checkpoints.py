"""Qwen-Image's and Qwen-Image-Edit's checkpoints: tiny pipelines of the real
architectures, and the real-size random-weight build.

- `build_text_to_image` (`tiny:text-to-image`): `QwenImagePipeline` with a Qwen2.5-VL text
  encoder, `QwenImageTransformer2DModel`, `AutoencoderKLQwenImage` and the published
  scheduler config; `build_image_edit` (`tiny:image-edit`): `QwenImageEditPipeline`, the
  same parts with their own weights, and the processor that shows the text encoder the
  input image. The references are the diffusers pipelines' own `__call__`.
- `build_scaled_image` (`scaled_checkpoint("Qwen/Qwen-Image", depth)`): the published
  text encoder, transformer and VAE configs, the text encoder's and the transformer's
  layers x `depth`, the VAE whole, saved as a diffusers pipeline folder.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from omniflow.catalog.components import builtin_files
from omniflow.checkpoints.scaled import check_depth, initialising_bf16_on, scale_into, scaled_layers
from omniflow.checkpoints.tiny_recipes import TEXT_DIMS, seed_weights
from omniflow.checkpoints.tiny_tokenizer import EDIT_CORPUS, build_tokenizer
from omniflow.families.qwen2_5_vl.checkpoints import VL_MAX_PIXELS, VL_MIN_PIXELS, qwen_vl_config
from omniflow.hf_logging import quiet

REAL_IMAGE = "Qwen/Qwen-Image"
# Qwen-Image's published scheduler_config.json.
QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
# The first 4 of Qwen-Image's 16 published latent channel statistics.
_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075]
_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558]


def _qwen_image_models(recipe: str, tokenizer) -> Generator[str, None, tuple[Any, Any, Any]]:
    """Qwen-Image's text encoder, transformer and VAE, tiny, seeded under `recipe`; yields
    each part's label before building it and returns the three models."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    yield "text_encoder"
    text_encoder = seed_weights(
        Qwen2_5_VLForConditionalGeneration(qwen_vl_config(tokenizer)), f"{recipe}/text_encoder"
    )

    yield "transformer"
    latent_channels = len(_LATENTS_MEAN)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=latent_channels * 4,
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIMS["hidden_size"],
        # RoPE dims per (frame, height, width) axis sum to the head dim, as (16, 56, 56).
        axes_dims_rope=(4, 6, 6),
    )
    seed_weights(transformer, f"{recipe}/transformer")

    yield "vae"
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=latent_channels,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=_LATENTS_MEAN,
        latents_std=_LATENTS_STD,
    )
    seed_weights(vae, f"{recipe}/vae")
    return text_encoder, transformer, vae


def build_text_to_image(out: Path) -> Iterator[str]:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    text_encoder, transformer, vae = yield from _qwen_image_models("text-to-image", tokenizer)

    yield "save"
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipeline.save_pretrained(out)


# --- image-edit ----------------------------------------------------------------------------

# Where QwenImageEditPipeline keeps its Qwen2VLProcessor: a folder of the tokenizer and the
# image processor, as in the published checkpoint.
EDIT_PROCESSOR = "processor"


def build_image_edit(out: Path) -> Iterator[str]:
    """QwenImageEditPipeline: Qwen-Image's parts, plus the processor that shows the text
    encoder the input image.

    diffusers saves every part but the processor: Qwen2VLProcessor cannot be constructed
    without torchvision (its video processor's class check), which omniflow does not
    require. So the pipeline is saved without it, and the processor's folder and index entry
    are written as the real checkpoint has them: the tokenizer and Qwen2.5-VL's image
    processor in `processor/`, `"processor": ["transformers", "Qwen2VLProcessor"]`.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessorPil

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen", EDIT_CORPUS)
    text_encoder, transformer, vae = yield from _qwen_image_models("image-edit", tokenizer)

    yield "processor"
    tokenizer.save_pretrained(out / EDIT_PROCESSOR)
    # Saved as `Qwen2VLImageProcessor`, as for qwen2.5-vl.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=VL_MIN_PIXELS, max_pixels=VL_MAX_PIXELS)
    image_processor.save_pretrained(out / EDIT_PROCESSOR)

    yield "save"
    pipeline = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=None,
        transformer=transformer,
    )
    pipeline.save_pretrained(out)
    index_file = out / "model_index.json"
    index = json.loads(index_file.read_text(encoding="utf-8"))
    index[EDIT_PROCESSOR] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --- real size ---


def scaled_image_config(
    depth: float = 1.0, files: dict[str, dict] | None = None
) -> tuple[Any, dict[str, Any], dict[str, Any], Any]:
    """(text encoder Qwen2_5_VLConfig, transformer config, VAE config, tokenizer) of
    Qwen-Image at real widths, the text encoder's and the transformer's layers x `depth`.
    `files`: the published config files to take the widths from (default: the catalog's)."""
    from transformers import Qwen2_5_VLConfig

    check_depth(depth)
    tokenizer = build_tokenizer("qwen")
    real = files or builtin_files(REAL_IMAGE)
    with quiet():  # the tiny config's ids warn against its tiny vocabulary
        config = qwen_vl_config(tokenizer).to_dict()
    text = real["text_encoder/config.json"]  # the published flat Qwen2.5-VL-7B layout
    scale_into(config, {("text_config",): text, ("vision_config",): text["vision_config"]}, depth)
    transformer, vae = (
        {k: v for k, v in real[f"{part}/config.json"].items() if not k.startswith("_")}
        for part in ("transformer", "vae")
    )
    transformer["num_layers"] = scaled_layers(transformer["num_layers"], depth)
    return Qwen2_5_VLConfig(**config), transformer, vae, tokenizer


def build_scaled_image(
    out: str | Path, depth: float = 1.0, device: str = "cuda", files: dict[str, dict] | None = None
) -> Path:
    """Build and save a random-weight Qwen-Image pipeline at real widths (a diffusers
    pipeline folder, what the diffusers backends load); returns the directory. `files` as
    for `scaled_image_config`."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    text, transformer, vae, tokenizer = scaled_image_config(depth, files)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    with initialising_bf16_on(device):
        pipeline = QwenImagePipeline(
            scheduler=scheduler,
            vae=AutoencoderKLQwenImage(**vae),
            text_encoder=Qwen2_5_VLForConditionalGeneration(text).eval(),
            tokenizer=tokenizer,
            transformer=QwenImageTransformer2DModel(**transformer),
        )
    out = Path(out)
    with quiet():
        pipeline.save_pretrained(out)
    return out

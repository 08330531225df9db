"""What the diffusers stage backends (`omniflow.backends.diffusion`, `.encoders`) need from a
Qwen-Image or Qwen-Image-Edit pipeline beyond diffusers' own helpers: `PIPELINES`, the
family's code for its `encoder`, `diffusion` and `vae` stages.

- which pipelines condition on an input image, and the size its `__call__` resizes it to
  (`calculate_dimensions`: about CONDITION_AREA pixels at the image's aspect ratio, sides
  multiples of 32); the edit pipeline's Qwen2VLProcessor, loaded without torchvision;
- the resolution-dependent timestep shift `mu` and the pipeline's sigmas;
- the transformer's forward on a batch of rows (timesteps / 1000, the image shapes its
  RoPE needs), its blocks on fused kernels on CUDA (`fused_blocks`);
- unpacking the transformer's 2x2 patches, and the VAE's latent statistics and its frame
  axis (it is a video VAE run on one frame).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

from omniflow.families.qwen_image.fused_blocks import fuse_blocks
from omniflow.hf_logging import quiet

# QwenImageEditPipeline.__call__ resizes the input image to about this many pixels.
CONDITION_AREA = 1024 * 1024
# Pipelines that condition on an input image (an `image` input on the encoder and denoiser).
_EDIT_PIPELINES = ("QwenImageEditPipeline",)


class _ImageProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor. transformers checks the class of every
    part a processor is given, and the video processor's base class needs torchvision, which
    omniflow does not require; the pipelines never pass videos, so none is given, and the
    check skips the missing part. Everything else is Qwen2VLProcessor's own code."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def load_processor(directory: str | Path) -> Qwen2VLProcessor:
    """An edit pipeline's Qwen2VLProcessor from its folder (the tokenizer and the image
    processor), for `from_pretrained(..., processor=...)`: diffusers' own loading of it
    needs torchvision (see `_ImageProcessor`)."""
    with quiet():
        return _ImageProcessor(
            image_processor=AutoImageProcessor.from_pretrained(directory),
            tokenizer=AutoTokenizer.from_pretrained(directory),
        )


class QwenImagePipelines:
    """The Qwen-Image pipelines' own code, as the diffusers backends call it."""

    def conditions_on_image(self, pipe) -> bool:
        return type(pipe).__name__ in _EDIT_PIPELINES

    def load_processor(self, directory: str | Path):
        return load_processor(directory)

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an edit pipeline's `__call__` resizes an input image to."""
        width, height, _ = calculate_dimensions(CONDITION_AREA, width / height)
        return width, height

    def vae_scale_factor(self, path: str) -> int:
        """`2 ** len(temperal_downsample)`, from the VAE's config (which the stage may not load)."""
        config = AutoencoderKLQwenImage.load_config(path, subfolder="vae")
        return 2 ** len(config["temperal_downsample"])

    def timesteps(self, scheduler, steps: int, image_tokens: int, device) -> torch.Tensor:
        """The pipeline's sigmas for `steps`, shifted by its resolution-dependent `mu`."""
        config = scheduler.config
        mu = calculate_shift(
            image_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(scheduler, steps, device, sigmas=sigmas, mu=mu)
        return timesteps

    def accelerate(self, transformer, device: str) -> None:
        """On CUDA, the transformer's blocks on fused kernels (the same computation)."""
        if torch.device(device).type == "cuda" and isinstance(
            transformer, QwenImageTransformer2DModel
        ):
            fuse_blocks(transformer)

    def forward(self, transformer, latents, timesteps, text, mask, shapes) -> torch.Tensor:
        """The transformer's velocity for a batch of rows (one set of image shapes)."""
        return transformer(
            hidden_states=latents,
            timestep=timesteps.to(latents.dtype) / 1000,
            guidance=None,
            # The pipeline passes no mask when no token is padding; neither do we.
            encoder_hidden_states_mask=None if mask.all() else mask,
            encoder_hidden_states=text,
            img_shapes=[list(shapes)] * len(latents),
            return_dict=False,
        )[0]

    def unpack(self, pipe, latents, height: int, width: int) -> torch.Tensor:
        """Packed latents -> `[1, C, h, w]`, still normalised."""
        return pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)[:, :, 0]

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents `[B, C, h, w]` -> images `[B, H, W, 3]` in [-1, 1]."""
        config = vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, vae.dtype)
        # The pipeline divides by the reciprocal of the std; so do we, for the same bits.
        inv_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(latents.device, vae.dtype)
        images = vae.decode(latents[:, :, None] / inv_std + mean, return_dict=False)[0][:, :, 0]
        return images.permute(0, 2, 3, 1).float()


PIPELINES = QwenImagePipelines()

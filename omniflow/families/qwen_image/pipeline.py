"""What the diffusers stage backends (`omniflow.backends.diffusion`, `.encoders`) need from a
Qwen-Image or Qwen-Image-Edit pipeline beyond diffusers' own helpers: `PIPELINES`, the
family's code for its `encoder`, `diffusion` and `vae` stages (the contract is in
`omniflow.backends.diffusion`'s docstring).

What `QwenImagePipeline.__call__` (and the edit pipeline's) decides, as it decides it:

- the knobs, by its names: `true_cfg_scale` is the classifier-free-guidance scale, on when
  it is > 1 and a negative prompt is given (`do_true_cfg`; the server's empty negative
  prompt is no negative prompt, so the encoder sends none); `guidance_scale` is the input of
  a guidance-distilled transformer (`guidance_embeds`), which the pipeline requires there
  and ignores (with a warning) anywhere else;
- which pipelines condition on an input image, and the size its `__call__` resizes it to
  (`calculate_dimensions`: about CONDITION_AREA pixels at the image's aspect ratio, sides
  multiples of 32); the edit pipeline's Qwen2VLProcessor, loaded without torchvision;
- the resolution-dependent timestep shift `mu` and the pipeline's sigmas;
- the transformer's forward on a batch of rows (timesteps / 1000, the image shapes its RoPE
  needs), its blocks on fused kernels on CUDA (`fused_blocks`), and where the step cache may
  split it (`cache_layout`);
- true CFG's rescale to the conditional prediction's norm; unpacking the transformer's 2x2
  patches, and the VAE's latent statistics and its frame axis (a video VAE run on one frame).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import (
    calculate_dimensions,
    retrieve_latents,
)
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

from omniflow.backends.diffusion import (
    Denoising,
    DiffusersBackendError,
    Prepare,
    check_sizes,
    condition_image,
    latent_moments,
    latent_statistics,
    timesteps_on,
)
from omniflow.backends.step_cache import CacheLayout
from omniflow.families.qwen_image.fused_blocks import fuse_blocks
from omniflow.hf_logging import quiet
from omniflow.runtime.readback import upload

log = logging.getLogger("omniflow.qwen_image")

# QwenImageEditPipeline.__call__ resizes the input image to about this many pixels.
CONDITION_AREA = 1024 * 1024
# Pipelines that condition on an input image (an `image` input on the encoder and denoiser).
_EDIT_PIPELINES = ("QwenImageEditPipeline",)
# What `QwenImagePipeline.__call__` defaults its knobs to.
TRUE_CFG_SCALE = 4.0
# A block call's arguments that hold one row per batch row (the rest: rotary tables, kwargs).
_BLOCK_ROWS = ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb")


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


class QwenImageDenoising(Denoising):
    """One Qwen-Image request between steps: packed latents `[1, patches, C * 4]` (an edit's
    input-image latents packed beside them), its true-CFG scale, its distilled guidance."""

    rescale = "norm"  # true CFG: rescaled to the conditional prediction's norm

    def __init__(self, pipe, *args, cfg_scale, guidance, shapes, image_latents, height, width):
        super().__init__(*args)
        self.pipe = pipe
        self.cfg_scale = cfg_scale
        self.guidance = guidance  # a distilled transformer's guidance input, else None
        self.shapes = shapes  # (frames, rows, columns) of patches: the output's, an edit's image
        self.image_latents = image_latents
        self.height, self.width = height, width

    def group(self):
        return self.shapes, self.guidance

    def scale(self) -> float:
        return self.cfg_scale

    def guided(self) -> bool:
        # `do_true_cfg`: true_cfg_scale > 1 and a negative prompt (one came with the prompt).
        return self.cfg_scale > 1 and len(self.prompts) == 2

    def model_input(self):
        latents = self.latents
        if self.image_latents is not None:
            latents = torch.cat([latents, self.image_latents], dim=1)
        return latents, self.timesteps[self.index : self.index + 1]

    def result(self) -> torch.Tensor:
        """Packed latents -> `[1, C, h, w]`, still normalised."""
        pipe = self.pipe
        return pipe._unpack_latents(self.latents, self.height, self.width, pipe.vae_scale_factor)[
            :, :, 0
        ]


def encode_image(pipe, image: torch.Tensor) -> torch.Tensor:
    """An edit's image latents of `image` (on the device), as the edit pipeline's
    `prepare_latents` makes them: the VAE's mode, normalised by the latents' mean and std
    (sent up without waiting: the pipeline copies them from pageable memory), packed."""
    latents = retrieve_latents(pipe.vae.encode(image), sample_mode="argmax")
    mean, std = latent_moments(pipe.vae.config, image.device, latents.dtype)
    latents = (latents - mean) / std
    _, channels, _, height, width = latents.shape
    return pipe._pack_latents(latents, 1, channels, height, width)


class QwenImagePipelines:
    """The Qwen-Image pipelines' own code, as the diffusers backends call it."""

    # --- loading ---
    def conditions_on_image(self, pipe, kind: str) -> bool:
        """The edit pipeline's text encoder and denoiser both see the input image."""
        return type(pipe).__name__ in _EDIT_PIPELINES

    def load_processor(self, directory: str | Path):
        return load_processor(directory)

    def denoiser_parts(self, image: bool) -> tuple[str, ...]:
        # An edit's input image is VAE-encoded in the denoiser, as prepare_latents does.
        return ("transformer", "scheduler") + (("vae",) if image else ())

    def setup(self, pipe, path: str, device: str) -> None:
        """The VAE scale the pipeline derives from the VAE (which the stage may not load),
        and the RoPE tables on the stage's device: diffusers keeps them on the host in plain
        attributes, which `.to()` does not move, and copies them up in the first forward, a
        host sync in the first request's first step."""
        config = AutoencoderKLQwenImage.load_config(path, subfolder="vae")
        pipe.vae_scale_factor = 2 ** len(config["temperal_downsample"])
        rope = pipe.transformer.pos_embed
        rope.pos_freqs, rope.neg_freqs = rope.pos_freqs.to(device), rope.neg_freqs.to(device)

    def fuse_blocks(self, pipe, attend) -> None:
        """The transformer's blocks on fused kernels (the same computation)."""
        if isinstance(pipe.transformer, QwenImageTransformer2DModel):
            fuse_blocks(pipe.transformer, attend)

    # --- the text encoder ---
    def negative_prompt(self, text: str | None) -> str | None:
        """The negative prompt a request's companion gives: none for an empty one (the
        server's "not given"), so the request is unguided, as `__call__` without one is."""
        return text or None

    def max_text_len(self, pipe) -> int:
        return pipe.tokenizer_max_length

    def encode(self, pipe, texts, images, max_len: int, device) -> list[torch.Tensor]:
        """Each text's embeddings `[n_i, H]` (the template's system prefix dropped; an
        edit's input image's tokens kept), `encode_prompt`'s own."""
        extra = {"image": images} if images is not None else {}
        embeds, mask = pipe.encode_prompt(
            texts, device=device, max_sequence_length=max_len, **extra
        )
        lengths = [embeds.shape[1]] * len(texts) if mask is None else mask.sum(dim=1).tolist()
        return [embeds[i, :n] for i, n in enumerate(lengths)]

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) an edit pipeline's `__call__` resizes an input image to."""
        width, height, _ = calculate_dimensions(CONDITION_AREA, width / height)
        return width, height

    # --- the denoiser ---
    def prepare(self, pipe, request: Prepare) -> QwenImageDenoising:
        knobs = request.knobs
        steps, height, width = knobs["steps"], knobs["height"], knobs["width"]
        patch = pipe.vae_scale_factor * 2
        check_sizes(patch, height=height, width=width)
        cfg_scale = float(knobs.get("true_cfg_scale", TRUE_CFG_SCALE))
        guidance = self._distilled_guidance(pipe, knobs.get("guidance_scale"))
        transformer, generator, device = pipe.transformer, request.generator, request.device
        shapes = ((1, height // patch, width // patch),)
        size = (1, transformer.config.in_channels // 4, height, width)
        dtype = request.dtype
        image_latents = None
        if request.image is None:  # drawn on the host (as on `device`), sent without waiting
            latents = upload(pipe.prepare_latents(*size, dtype, "cpu", generator), device)
        else:  # the same, and the image sent up and encoded as `prepare_latents` does
            image = condition_image(pipe, self, request.image)
            pixels = pipe.image_processor.preprocess(image, image.height, image.width)
            latents = upload(pipe.prepare_latents(None, *size, dtype, "cpu", generator)[0], device)
            image_latents = encode_image(pipe, upload(pixels.unsqueeze(2), device, dtype))
            shapes += ((1, image.height // patch, image.width // patch),)
        scheduler = pipe.scheduler.__class__.from_config(pipe.scheduler.config)
        self.schedule(scheduler, steps, latents.shape[1])
        timesteps = timesteps_on(scheduler, device)
        scheduler.set_begin_index(0)
        return QwenImageDenoising(
            pipe,
            request.prompts,
            scheduler,
            timesteps,
            latents,
            generator,
            cfg_scale=cfg_scale,
            guidance=guidance,
            shapes=shapes,
            image_latents=image_latents,
            height=height,
            width=width,
        )

    @staticmethod
    def _distilled_guidance(pipe, scale):
        """`__call__`'s guidance input: the scale for a guidance-distilled transformer (which
        needs one), None (the scale ignored, as `__call__` ignores it) for any other."""
        if pipe.transformer.config.guidance_embeds:
            if scale is None:
                raise DiffusersBackendError(
                    "guidance_scale is required for a guidance-distilled transformer"
                )
            return float(scale)
        return None

    def schedule(self, scheduler, steps: int, image_tokens: int) -> None:
        """`scheduler` set on the host to the pipeline's sigmas for `steps`, shifted by its
        resolution-dependent `mu`."""
        config = scheduler.config
        mu = calculate_shift(
            image_tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        retrieve_timesteps(scheduler, steps, "cpu", sigmas=sigmas, mu=mu)

    def forward(self, pipe, group, hidden, timesteps, text, mask) -> torch.Tensor:
        """The transformer's velocity for a batch of rows (one set of image shapes); an
        edit's rows end with its input image's latents: the prediction is the rest."""
        shapes, guidance = group
        transformer = pipe.transformer
        if guidance is not None:
            guidance = torch.full([len(hidden)], guidance, device=hidden.device)
        noise = transformer(
            hidden_states=hidden,
            timestep=timesteps.to(hidden.dtype) / 1000,
            guidance=guidance,
            # The pipeline passes no mask when no token is padding; neither do we (None).
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=text,
            img_shapes=[list(shapes)] * len(hidden),
            return_dict=False,
        )[0]
        rows, columns = shapes[0][1:]
        return noise[:, : rows * columns]

    def cache_layout(self, pipe, group) -> CacheLayout | None:
        """The dual-stream blocks: per-row hidden states, text states, mask and time
        embedding; the image stream is compared and cached (the output reads it alone). An
        edit model's per-token modulation (`zero_cond_t`) doubles the time embedding's rows:
        not split."""
        transformer = pipe.transformer
        if getattr(transformer, "zero_cond_t", False):
            return None
        return CacheLayout(
            blocks=transformer.transformer_blocks,
            row_positions=(),
            row_names=_BLOCK_ROWS,
            streams=tuple,  # (encoder_hidden_states, hidden_states)
            rebuild=tuple,
            inputs=lambda args, kwargs: (kwargs["encoder_hidden_states"], kwargs["hidden_states"]),
            probe=1,
            cached=(1,),
        )

    # --- the VAE ---
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents `[B, C, h, w]` -> images `[B, H, W, 3]` in [-1, 1]."""
        mean, inv_std = latent_statistics(vae.config, latents.device, vae.dtype)
        images = vae.decode(latents[:, :, None] / inv_std + mean, return_dict=False)[0][:, :, 0]
        return images.permute(0, 2, 3, 1).float()


PIPELINES = QwenImagePipelines()

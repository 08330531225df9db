"""What the diffusers stage backends (`omniflow.backends.diffusion`, `.encoders`) need from
Wan2.2's `WanPipeline` and `WanImageToVideoPipeline` beyond diffusers' own helpers:
`PIPELINES`, the family's code for its `encoder`, `diffusion` and `vae` stages (the contract
is in `omniflow.backends.diffusion`'s docstring).

What `WanPipeline.__call__` (and the image-to-video pipeline's) decides, as it decides it:

- the prompt: UMT5's last hidden states of the tokenized prompt, cut to its tokens and
  zero-padded to `max_sequence_length` (512): the transformer attends to every row, so the
  encoder stage sends them padded. The negative prompt: "" when none is given.
- the knobs: classifier-free guidance is on when `guidance_scale` > 1 (both rows of every
  step, whichever expert runs it); the high-noise `transformer` runs the steps whose
  timestep is at least `boundary_ratio` x `num_train_timesteps`, at `guidance_scale`, the
  low-noise `transformer_2` the rest, at `guidance_scale_2` (`guidance_scale` when unset).
  The request's `boundary_ratio` and `flow_shift` replace the checkpoint's (the pipeline's
  config, the scheduler's) for that request alone: each request has its own scheduler.
- sizes: height and width multiples of the VAE's spatial scale x the patch (16; 32 for the
  Wan2.2 VAE), `num_frames` made `num_frames // 4 * 4 + 1` as `__call__` makes it
  (`omniflow.catalog.components.video_frames`, which the compiler sizes the latents by).
- latents float32 (`prepare_latents(..., torch.float32)`), the transformer's input cast
  to its dtype; image-to-video (A14B): the input image resized to the output size, VAE
  encoded as the first of `num_frames` (the rest zeros), normalised, with a 4-channel
  first-frame mask, concatenated to the noise latents by channels at every step;
  `expand_timesteps` (TI2V-5B): one timestep per token, the conditioning first frame's
  tokens at 0, its latents put back in place of the first frame at every step and at the
  end.
- plain CFG, `uncond + scale x (cond - uncond)`, then the scheduler's (UniPC's) step.
- the VAE's latent statistics (the pipeline divides by the reciprocal of the std).

On CUDA each expert's blocks run on fused kernels (`fused_blocks`; the stage's `blocks`
setting turns them off).

Two experts share no forward: a request's rows go to the expert of its current step, so
requests at steps on either side of the boundary run as two forwards of one `step()`.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanTransformer3DModel
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, unpatchify
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
from diffusers.video_processor import VideoProcessor

from omniflow.backends.diffusion import (
    Denoising,
    DiffusersBackendError,
    FrameDecoding,
    Prepare,
    check_sizes,
    latent_statistics,
    open_image,
    timesteps_on,
)
from omniflow.backends.step_cache import CacheLayout
from omniflow.catalog.components import video_frames
from omniflow.families.wan.fused_blocks import fuse_blocks
from omniflow.runtime.readback import upload

# What `WanPipeline.__call__` defaults its knobs to.
GUIDANCE_SCALE = 5.0
MAX_SEQUENCE_LENGTH = 512


class WanDenoising(Denoising):
    """One Wan request between steps: float32 latents `[1, C, F', h, w]`, its guidance
    scales, its expert boundary, and an image-to-video request's conditioning."""

    def __init__(self, pipe, *args, scales, experts, condition, mask):
        super().__init__(*args)
        self.pipe = pipe
        self.scales = scales  # (guidance_scale, guidance_scale_2)
        self.experts = experts  # each step's expert (None: one expert), decided on the host
        self.condition = condition  # image-to-video: channels beside (A14B) or first frame
        self.mask = mask  # TI2V: 0 on the conditioning first frame, 1 elsewhere
        self.dtype = (pipe.transformer or pipe.transformer_2).dtype

    def expert(self) -> int:
        return 0 if self.experts is None else self.experts[self.index]

    def group(self):
        return tuple(self.latents.shape), self.expert(), self.condition is not None

    def scale(self) -> float:
        return self.scales[self.expert()]

    def guided(self) -> bool:
        # `do_classifier_free_guidance`: guidance_scale alone decides, for both experts.
        return self.scales[0] > 1.0 and len(self.prompts) == 2

    def model_input(self):
        t = self.timesteps[self.index]
        latents = self.latents
        if self.pipe.config.expand_timesteps and self.condition is not None:
            # TI2V's image-to-video: the image's first frame at timestep 0, the rest at t.
            latents = (1 - self.mask) * self.condition + self.mask * latents
            timestep = (self.mask[0][0][:, ::2, ::2] * t).flatten()[None]
        else:
            # Without an image every token of a TI2V video is at t, as the pipeline's per-token
            # timesteps say: one row's, not a modulation per token (the time embedding of each
            # of 27k tokens, and in every block a float32 [tokens, 6, width] table, 4 GB).
            if self.condition is not None:
                latents = torch.cat([latents, self.condition], dim=1)
            timestep = t.expand(1)
        return latents.to(self.dtype), timestep

    def result(self) -> torch.Tensor:
        latents = self.latents
        if self.pipe.config.expand_timesteps and self.condition is not None:
            latents = (1 - self.mask) * self.condition + self.mask * latents
        return latents


class WanPipelines:
    """The Wan2.2 pipelines' own code, as the diffusers backends call it."""

    # --- loading ---
    def pipeline_class(self, index: dict, image: bool):
        """An image-conditioned denoiser runs WanImageToVideoPipeline: the I2V checkpoints'
        own, and TI2V-5B's (a WanPipeline folder with `expand_timesteps`) image-to-video."""
        if image and (
            index.get("_class_name") == "WanImageToVideoPipeline" or index.get("expand_timesteps")
        ):
            return WanImageToVideoPipeline
        return None

    def conditions_on_image(self, pipe, kind: str) -> bool:
        """Only the denoiser sees the input image (Wan2.2 has no image encoder)."""
        return kind == "diffusion" and isinstance(pipe, WanImageToVideoPipeline)

    def denoiser_parts(self, image: bool) -> tuple[str, ...]:
        # The image-to-video input is VAE-encoded in the denoiser, as prepare_latents does.
        return ("transformer", "transformer_2", "scheduler") + (("vae",) if image else ())

    def setup(self, pipe, path: str, device: str) -> None:
        """The VAE scales the pipeline's `__init__` derives from the VAE it may not have."""
        if getattr(pipe, "vae", None) is None:
            config = AutoencoderKLWan.load_config(path, subfolder="vae")
            pipe.vae_scale_factor_temporal = config["scale_factor_temporal"]
            pipe.vae_scale_factor_spatial = config["scale_factor_spatial"]
            pipe.video_processor = VideoProcessor(vae_scale_factor=pipe.vae_scale_factor_spatial)

    def fuse_blocks(self, pipe, attend) -> None:
        """Each expert's blocks on fused kernels (`fused_blocks`: the same computation)."""
        for part in ("transformer", "transformer_2"):
            expert = getattr(pipe, part, None)
            if isinstance(expert, WanTransformer3DModel):
                fuse_blocks(expert, attend)

    # --- the text encoder ---
    def negative_prompt(self, text: str | None) -> str:
        return text or ""  # `negative_prompt or ""`: always encoded under guidance

    def max_text_len(self, pipe) -> int:
        return pipe.tokenizer.model_max_length

    def encode(self, pipe, texts, images, max_len: int, device) -> list[torch.Tensor]:
        """Each text's embeddings, zero-padded to `max_len` rows as `__call__` pads them."""
        embeds = pipe._get_t5_prompt_embeds(
            prompt=texts, max_sequence_length=max_len, device=device
        )
        return list(embeds)

    # --- the denoiser ---
    def prepare(self, pipe, request: Prepare) -> WanDenoising:
        knobs, device, generator = request.knobs, request.device, request.generator
        steps, height, width = knobs["steps"], knobs["height"], knobs["width"]
        transformer = pipe.transformer or pipe.transformer_2
        patch = transformer.config.patch_size
        check_sizes(pipe.vae_scale_factor_spatial * patch[1], height=height, width=width)
        frames = video_frames(knobs.get("frames", 1), pipe.vae_scale_factor_temporal)
        scales, boundary = self._experts(pipe, knobs)
        shift = knobs.get("flow_shift")
        config = dict(pipe.scheduler.config)
        if shift is not None:
            config["flow_shift"] = float(shift)
        scheduler = pipe.scheduler.__class__.from_config(config)
        scheduler.set_timesteps(steps, device="cpu")
        scheduler.set_begin_index(0)
        # Each step's expert from the boundary timestep, on the host (the timesteps are still
        # there: comparing them on the device would be a host sync).
        experts = None
        if boundary is not None:
            boundary_t = boundary * scheduler.config.num_train_timesteps
            experts = [0 if t >= boundary_t else 1 for t in scheduler.timesteps.tolist()]
        timesteps = timesteps_on(scheduler, device)
        # The noise as `prepare_latents` draws it (the request's generator is a host one, so
        # its `randn_tensor` draws there, then copies up from pageable memory: a host sync
        # that waits for every other request's queued steps), sent without waiting.
        condition = mask = None
        channels = transformer.config.in_channels
        if request.image is not None:  # (the condition's channels join the noise's each step)
            channels = pipe.vae.config.z_dim
            condition, mask = _condition(pipe, request.image, frames, height, width, device)
        shape = (1, channels, *_latent_size(pipe, frames, height, width))
        latents = upload(torch.randn(shape, generator=generator, dtype=torch.float32), device)
        return WanDenoising(
            pipe,
            request.prompts,
            scheduler,
            timesteps,
            latents,
            generator,
            scales=scales,
            experts=experts,
            condition=condition,
            mask=mask,
        )

    @staticmethod
    def _experts(pipe, knobs) -> tuple[tuple[float, float], float | None]:
        """((guidance_scale, guidance_scale_2), boundary_ratio), checked as `__call__`'s
        `check_inputs` checks them."""
        boundary = knobs.get("boundary_ratio", pipe.config.boundary_ratio)
        two = getattr(pipe, "transformer_2", None) is not None
        if boundary is not None and not two:
            raise DiffusersBackendError(
                "boundary_ratio switches between two experts; this checkpoint has one transformer"
            )
        if two and boundary is None:
            raise DiffusersBackendError("a two-expert checkpoint needs a boundary_ratio")
        scale = float(knobs.get("guidance_scale", GUIDANCE_SCALE))
        scale_2 = knobs.get("guidance_scale_2")
        if scale_2 is not None and boundary is None:
            raise DiffusersBackendError(
                "guidance_scale_2 is only supported when the pipeline's boundary_ratio is set"
            )
        return (scale, scale if scale_2 is None else float(scale_2)), boundary

    def forward(self, pipe, group, hidden, timesteps, text, mask) -> torch.Tensor:
        """The current expert's prediction for a batch of rows (the text rows are all
        `max_sequence_length` long: no mask)."""
        transformer = pipe.transformer if group[1] == 0 else pipe.transformer_2
        return transformer(
            hidden_states=hidden,
            timestep=timesteps,
            encoder_hidden_states=text,
            return_dict=False,
        )[0]

    def cache_layout(self, pipe, group) -> CacheLayout:
        """The expert's blocks, called `block(hidden, text, timestep_proj, rotary)`: the first
        three per row; one stream, compared and cached."""
        transformer = pipe.transformer if group[1] == 0 else pipe.transformer_2
        return CacheLayout(
            blocks=transformer.blocks,
            row_positions=(0, 1, 2),
            row_names=("hidden_states", "encoder_hidden_states", "temb"),
            streams=lambda out: (out,),
            rebuild=lambda streams: streams[0],
            inputs=lambda args, kwargs: (args[0] if args else kwargs["hidden_states"],),
            probe=0,
            cached=(0,),
        )

    # --- the VAE ---
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents `[B, C, F', h, w]` -> frames `[B, F, H, W, 3]` in [-1, 1]."""
        video = vae.decode(_vae_latents(vae, latents), return_dict=False)[0]
        return video.permute(0, 2, 3, 4, 1).float()

    def decode_in_steps(self, vae, latents: torch.Tensor) -> WanFrameDecoding:
        """`decode` of one video a latent frame a step (the same frames)."""
        return WanFrameDecoding(vae, _vae_latents(vae, latents))


def _latent_size(pipe, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """A video's latent frames, height and width."""
    t, s = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    return (frames - 1) // t + 1, height // s, width // s


def _condition(pipe, image, frames: int, height: int, width: int, device):
    """An image-to-video request's conditioning and mask as the image-to-video pipeline's
    `prepare_latents` makes them, with nothing copied up from pageable memory (a host sync:
    it would wait for every other request's queued steps). The image resized, sent up and
    VAE-encoded as the first of `frames` (the rest zeros; alone with `expand_timesteps`),
    normalised by the latents' mean and std. A14B: the 4-channel first-frame mask (the
    pipeline's, one channel per frame of the VAE's temporal scale: ones at the first latent
    frame) before it by channels, no mask. TI2V (`expand_timesteps`): the condition, and a
    mask of ones but for the first latent frame."""
    pixels = pipe.video_processor.preprocess(open_image(image), height=height, width=width)
    pixels = upload(pixels, device, torch.float32).unsqueeze(2)
    expand = pipe.config.expand_timesteps
    if not expand:
        rest = pixels.new_zeros(*pixels.shape[:2], frames - 1, height, width)
        pixels = torch.cat([pixels, rest], dim=2)
    encoded = retrieve_latents(pipe.vae.encode(pixels.to(pipe.vae.dtype)), sample_mode="argmax")
    mean, inverse_std = latent_statistics(pipe.vae.config, device, torch.float32)
    condition = (encoded.to(torch.float32) - mean) * inverse_std
    size = _latent_size(pipe, frames, height, width)
    if expand:
        mask = torch.ones(1, 1, *size, device=device)
        mask[:, :, 0] = 0
        return condition, mask
    first = torch.zeros(1, pipe.vae_scale_factor_temporal, *size, device=device)
    first[:, :, 0] = 1
    return torch.cat([first, condition], dim=1), None


def _vae_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents with the VAE's latent statistics applied, as the pipeline does."""
    mean, inv_std = latent_statistics(vae.config, latents.device, latents.dtype)
    return latents / inv_std + mean


class WanFrameDecoding(FrameDecoding):
    """`AutoencoderKLWan._decode` (no tiling), a latent frame a step: its causal decoder
    runs each frame on the cache of the frames before, here this decode's own (the VAE's
    own cache is one for all), so several videos' decodes may interleave."""

    def __init__(self, vae, latents: torch.Tensor):
        super().__init__(total=latents.shape[2])
        self.vae = vae
        self.latents = vae.post_quant_conv(latents)
        convs = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
        self.cache: list = [None] * convs
        self.frames: list[torch.Tensor] = []

    def advance(self) -> None:
        i = self.done
        frame = self.latents[:, :, i : i + 1]
        self.frames.append(
            self.vae.decoder(frame, feat_cache=self.cache, feat_idx=[0], first_chunk=i == 0)
        )
        self.done += 1

    def result(self) -> torch.Tensor:
        video = torch.cat(self.frames, 2)
        if self.vae.config.patch_size is not None:
            video = unpatchify(video, patch_size=self.vae.config.patch_size)
        return video.clamp(-1.0, 1.0).permute(0, 2, 3, 4, 1).float()


PIPELINES = WanPipelines()

"""Sampling knobs that several model families add to a stage kind under one name.

The registry requires a stage parameter's name to mean one spec within a kind whichever
family adds it (`families._claims`), so families whose pipelines share a knob's name take
its spec from here; what the knob does is each family's own (its pipeline code reads it):
`guidance_scale` is Wan's classifier-free-guidance scale and, for Qwen-Image, the input of a
guidance-distilled transformer. Torch-free: descriptors import it.
"""

from __future__ import annotations

from omniflow.ir.kinds import ParamSpec

_FLOAT = (float, int)

# diffusers' `guidance_scale`; unset, the pipeline's own default (its family's code says).
GUIDANCE_SCALE = ParamSpec(_FLOAT, low=0, high=100, model_default=True)
# The VAE decodes in tiles / one latent at a time (diffusers' `enable_tiling`,
# `enable_slicing`): the peer's `vae_use_tiling`, `vae_use_slicing`.
VAE_OPTIONS = {
    "vae_use_tiling": ParamSpec((bool,), False),
    "vae_use_slicing": ParamSpec((bool,), False),
}
# The omni processors' `use_audio_in_video` (a request's `mm_processor_kwargs`): each video
# interleaved with its audio track, the next audio item (Qwen2.5-Omni's and Qwen3-Omni's
# thinkers).
USE_AUDIO_IN_VIDEO = ParamSpec((bool,), False)

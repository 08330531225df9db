"""Wan2.2 (`model_index.json` `_class_name` WanPipeline, WanImageToVideoPipeline): a UMT5-XXL
text encoder, the Wan video DiT (`WanTransformer3DModel`) and the causal-3D video VAE
(`AutoencoderKLWan`), run step-wise by the diffusers backends.

- Wan2.2-T2V-A14B and I2V-A14B: two 14B experts, the high-noise `transformer` for timesteps
  at or above `boundary_ratio` x 1000 and the low-noise `transformer_2` below, each at its
  own classifier-free-guidance scale (`guidance_scale`, `guidance_scale_2`); I2V conditions
  on an input image by channels (a first-frame mask and the image's VAE latents beside the
  noise), without an image encoder.
- Wan2.2-TI2V-5B: one 5B expert over the Wan2.2 VAE's 48 channels (16x spatial), per-token
  timesteps (`expand_timesteps`); image-to-video replaces the first latent frame by the
  input image's and gives its tokens timestep 0.

The knobs are WanPipeline's own names: `guidance_scale` (CFG, on above 1), `guidance_scale_2`,
and, per request, what the checkpoint's configs fix for `__call__`: the pipeline's
`boundary_ratio` and the scheduler's `flow_shift`. The peer's client sends all of them.

Run-time half: `pipeline` (what the diffusers backends need of the pipelines' own code),
`fused_blocks` (the video DiT's blocks on fused kernels on CUDA), `checkpoints` (tiny and
real-size random-weight builds). The video DiT's cost formula is
`costs` (torch-free, the compiler's).
"""

from __future__ import annotations

from omniflow.families.family import Family, Part, TinyModel, diffusers_runtime
from omniflow.families.knobs import GUIDANCE_SCALE, VAE_OPTIONS
from omniflow.families.wan.costs import cost
from omniflow.ir.kinds import ParamSpec

_HERE = __name__
_FLOAT = (float, int)


def admission(stage, path: str):
    """`Family.admission`: the denoiser's height and width, multiples of the VAE's spatial
    scale (`WanPipeline.vae_scale_factor_spatial`) x the transformer's patch."""
    from omniflow.families.denoiser_sizes import component_config, patch_width, size_check

    scale = int(component_config(path, "vae").get("scale_factor_spatial", 8))
    return size_check(stage, scale * patch_width(component_config(path, "transformer")))


# The video VAE decodes one latent frame at a time, its causal convolutions carrying the
# frames before (diffusers' decode and the vae stage's, a frame a step): its activations are
# one latent frame's outputs, not the whole video's.
_VAE_FACTS = {"vae": {"latent_frames_per_decode": 1}}


def _two_experts(index) -> bool:
    entry = index.get("transformer_2")
    return isinstance(entry, list) and entry[0] is not None


def _t2v_facts(index) -> dict:
    """A two-expert WanPipeline's denoiser loads `transformer_2` beside `transformer`. With
    `expand_timesteps` (TI2V-5B) the time embedding runs per token, and the pipeline
    generates from text or, loaded as WanImageToVideoPipeline, from an image: its denoiser
    may take one. The image goes in as the first latent frame: no extra tokens."""
    facts: dict = {}
    if _two_experts(index):
        facts["experts"] = ("transformer_2",)
    if index.get("expand_timesteps"):
        facts |= {
            "expand_timesteps": True,
            "condition_image_tokens": 0,
            "condition_image_optional": True,
        }
    return {
        "transformer": facts,
        "transformer_2": {k: v for k, v in facts.items() if k != "experts"},
        **_VAE_FACTS,
    }


def _i2v_facts(index) -> dict:
    """The image-to-video A14B conditions its experts on the input image by channels (no
    extra tokens); its denoiser loads both."""
    facts = {"condition_image_tokens": 0}
    first = {**facts, "experts": ("transformer_2",)} if _two_experts(index) else facts
    return {"transformer": first, "transformer_2": facts, **_VAE_FACTS}


FAMILY = Family(
    name="wan",
    doc=__doc__,
    architectures=("WanPipeline", "WanImageToVideoPipeline", "umt5"),
    cost=cost,
    admission=f"{_HERE}:admission",
    # The text encoder: google/umt5-xxl's UMT5EncoderModel, its dims in T5's spelling.
    parts={
        "text_encoder": Part(
            "text_encoder",
            (),
            renames={
                "d_model": "hidden_size",
                "num_layers": "num_hidden_layers",
                "num_heads": "num_attention_heads",
                "d_kv": "head_dim",
                "d_ff": "intermediate_size",
            },
        )
    },
    pipeline_facts={"WanPipeline": _t2v_facts, "WanImageToVideoPipeline": _i2v_facts},
    runtime=diffusers_runtime(_HERE),
    stage_params={
        "diffusion": {
            # Unset, each is WanPipeline's: guidance_scale 5.0, guidance_scale_2 =
            # guidance_scale, the checkpoint's boundary_ratio and flow_shift.
            "guidance_scale": GUIDANCE_SCALE,
            "guidance_scale_2": ParamSpec(_FLOAT, low=0, high=100, model_default=True),
            "boundary_ratio": ParamSpec(_FLOAT, low=0, high=1, model_default=True),
            "flow_shift": ParamSpec(_FLOAT, low=0, high=100, model_default=True),
        },
        "vae": VAE_OPTIONS,
    },
    tiny=(
        TinyModel(
            "wan2.2-t2v",
            "WanPipeline of Wan2.2-T2V-A14B: UMT5 text encoder, two WanTransformer3DModel "
            "experts (boundary_ratio 0.875), AutoencoderKLWan (Wan2.1), UniPC",
            ("tokenizer", "text_encoder", "transformer", "transformer_2", "vae", "save"),
            f"{_HERE}.checkpoints:build_t2v",
            counterparts=("Wan-AI/Wan2.2-T2V-A14B-Diffusers",),
        ),
        TinyModel(
            "wan2.2-i2v",
            "WanImageToVideoPipeline of Wan2.2-I2V-A14B: the experts on 36 channels (noise, "
            "first-frame mask, image latents; boundary_ratio 0.9), no image encoder",
            ("tokenizer", "text_encoder", "transformer", "transformer_2", "vae", "save"),
            f"{_HERE}.checkpoints:build_i2v",
            counterparts=("Wan-AI/Wan2.2-I2V-A14B-Diffusers",),
        ),
        TinyModel(
            "wan2.2-ti2v",
            "WanPipeline of Wan2.2-TI2V-5B: one expert over 48 channels, expand_timesteps, "
            "the Wan2.2 VAE (residual, 2x2 patchified, 16x spatial)",
            ("tokenizer", "text_encoder", "transformer", "vae", "save"),
            f"{_HERE}.checkpoints:build_ti2v",
            counterparts=("Wan-AI/Wan2.2-TI2V-5B-Diffusers",),
        ),
    ),
    scaled={
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers": f"{_HERE}.checkpoints:build_scaled_t2v",
        "Wan-AI/Wan2.2-I2V-A14B-Diffusers": f"{_HERE}.checkpoints:build_scaled_i2v",
        "Wan-AI/Wan2.2-TI2V-5B-Diffusers": f"{_HERE}.checkpoints:build_scaled_ti2v",
    },
)

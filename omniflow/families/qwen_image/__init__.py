"""Qwen-Image and Qwen-Image-Edit (`model_index.json` `_class_name` QwenImagePipeline,
QwenImageEditPipeline): a Qwen2.5-VL text encoder, the MMDiT `QwenImageTransformer2DModel`
and the `AutoencoderKLQwenImage` VAE, run step-wise by the diffusers backends.

Run-time half: `pipeline` (what the diffusers backends need of the pipelines' own code),
`fused_blocks` (the MMDiT's blocks on fused kernels on CUDA); `checkpoints` (tiny, real size).
The MMDiT's cost formula is `costs` (torch-free, the compiler's).
"""

from __future__ import annotations

from omniflow.families.family import Family, TinyModel, diffusers_runtime
from omniflow.families.knobs import GUIDANCE_SCALE, VAE_OPTIONS
from omniflow.families.qwen_image.costs import cost
from omniflow.ir.kinds import ParamSpec

_HERE = __name__


def admission(stage, path: str):
    """`Family.admission`: the denoiser's height and width, multiples of the VAE's scale
    (2 per temporal downsampling stage, as `QwenImagePipeline.vae_scale_factor`) x the
    transformer's patch, which the latents are packed by; an edit pipeline's input image,
    which its text encoder sees through Qwen2.5-VL's processor, within that processor's
    aspect ratio."""
    from omniflow.families.denoiser_sizes import component_config, patch_width, size_check

    if stage.kind == "encoder":
        from omniflow.families.qwen2_5_vl import check_aspect_ratios

        return check_aspect_ratios

    scale = 2 ** len(component_config(path, "vae").get("temperal_downsample", (0, 0, 0)))
    return size_check(stage, scale * patch_width(component_config(path, "transformer")))


FAMILY = Family(
    name="qwen_image",
    doc=__doc__,
    architectures=("QwenImagePipeline", "QwenImageEditPipeline"),
    cost=cost,
    admission=f"{_HERE}:admission",
    pipeline_facts={
        # QwenImageEditPipeline.__call__ resizes the input image to about 1024 x 1024 pixels
        # at its own aspect ratio (`calculate_dimensions(1024 * 1024, ratio)`: sides multiples
        # of 32), whatever the output size. The text encoder sees it through Qwen2VLProcessor
        # as one token per 28 x 28 pixels (its smart_resize: 1369 for a square image) and the
        # transformer as VAE latents in 2 x 2 patches, one token per 16 x 16 pixels (4096),
        # beside the noise latents. Each count is the most over every aspect ratio the
        # processor accepts (up to 200:1); tests/catalog/test_catalog.py re-derives both.
        "QwenImageEditPipeline": {
            "text_encoder": {"condition_image_tokens": 1675},
            "transformer": {"condition_image_tokens": 4920},
        },
    },
    # The knobs of QwenImagePipeline.__call__, by its names: `true_cfg_scale` is its
    # classifier-free guidance (on above 1, with a negative prompt; default 4.0), and
    # `guidance_scale` the input of a guidance-distilled transformer, which the pipeline
    # ignores for any other (Qwen-Image's is not distilled). The VAE's tiling and slicing.
    stage_params={
        "diffusion": {
            "true_cfg_scale": ParamSpec((float, int), 4.0, low=0, high=100),
            "guidance_scale": GUIDANCE_SCALE,
        },
        "vae": VAE_OPTIONS,
    },
    runtime=diffusers_runtime(_HERE),
    tiny=(
        TinyModel(
            "text-to-image",
            "QwenImagePipeline: Qwen2.5-VL text encoder, QwenImageTransformer2DModel, "
            "AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler",
            ("tokenizer", "text_encoder", "transformer", "vae", "save"),
            f"{_HERE}.checkpoints:build_text_to_image",
            counterparts=("Qwen/Qwen-Image",),
        ),
        TinyModel(
            "image-edit",
            "QwenImageEditPipeline: the text-to-image parts (its own weights) and the "
            "Qwen2VLProcessor that shows the text encoder the input image",
            ("tokenizer", "text_encoder", "transformer", "vae", "processor", "save"),
            f"{_HERE}.checkpoints:build_image_edit",
            counterparts=("Qwen/Qwen-Image-Edit",),
        ),
    ),
    scaled={"Qwen/Qwen-Image": f"{_HERE}.checkpoints:build_scaled_image"},
)

"""Qwen2.5-VL's vision tower alone, for the transformers `encoder` backend
(`omniflow.backends.vision`, which packs its embeddings with their patch grid).

The tower loads through `Qwen2_5_VisionTransformerPretrainedModel.from_pretrained` on the
checkpoint directory, its weights mapped from the checkpoint's `visual.` prefix
(transformers 5 names the module `model.visual`); the language model's weights are skipped.
The image processor is the checkpoint's own (`AutoImageProcessor`).
"""

from __future__ import annotations

from omniflow.backends.vision import VisionBackendError

COMPONENT = "visual"


def load(path: str, component: str | None, dtype):
    """(tower, its loading info, the image processor) of the checkpoint at `path`."""
    from transformers import AutoImageProcessor, Qwen2_5_VisionTransformerPretrainedModel

    if component not in (None, COMPONENT):
        raise VisionBackendError(
            f"Qwen2.5-VL's vision tower is its component '{COMPONENT}', not '{component}'"
        )
    tower, info = Qwen2_5_VisionTransformerPretrainedModel.from_pretrained(
        path, key_mapping={r"^(model\.)?visual\.": ""}, dtype=dtype, output_loading_info=True
    )
    return tower, info, AutoImageProcessor.from_pretrained(path)

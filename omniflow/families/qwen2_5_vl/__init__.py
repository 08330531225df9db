"""Qwen2.5-VL (`model_type` qwen2_5_vl): a vision tower whose patch embeddings, with their
grid, feed a language model with multimodal RoPE.

Run-time half: `vision_tower` (the tower for the transformers `encoder` backend),
`language_model` (the LM on image embeddings for the transformers `ar` backend);
`checkpoints` (tiny, reference).
"""

from __future__ import annotations

from omniflow.families.family import Family, Part, TinyModel

_HERE = __name__

FAMILY = Family(
    name="qwen2_5_vl",
    doc=__doc__,
    architectures=("qwen2_5_vl",),
    parts={
        "visual": Part("vision_encoder", ("vision_config",), weights=("visual.", "model.visual.")),
        "language_model": Part("decoder_lm", ("text_config?",), class_level=0),
    },
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

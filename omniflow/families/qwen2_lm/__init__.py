"""Qwen2.5 chat LMs (`model_type` qwen2): plain decoders, run by the generic causal-LM path
of the `ar` backends (transformers, vLLM); this family holds their tiny counterpart, and the
cost rule of every Qwen2 and Qwen3 decoder (`costs`), which the other Qwen families' LMs are."""

from __future__ import annotations

from omniflow.families.family import Family, TinyModel
from omniflow.families.qwen2_lm.costs import cost

_BUILD = f"{__name__}.checkpoints"

FAMILY = Family(
    name="qwen2_lm",
    doc=__doc__,
    architectures=("qwen2",),
    cost=cost,
    tiny=(
        TinyModel(
            "qwen2",
            "Qwen2ForCausalLM: 2-layer, 64-wide Qwen2.5-style chat LM with tied embeddings",
            ("tokenizer", "model", "save"),
            f"{_BUILD}:build_qwen2",
            counterparts=("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),
        ),
        TinyModel(
            "qwen2-wide-heads",
            "the qwen2 weights split into 2 attention heads of 32 (vLLM's CPU attention needs >= 32)",
            ("tokenizer", "model", "save"),
            f"{_BUILD}:build_qwen2_wide_heads",
        ),
    ),
)

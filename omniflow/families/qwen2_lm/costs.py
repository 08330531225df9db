"""The cost rule of Qwen's decoder LMs (torch-free; the descriptor's `cost`): every Qwen2 and
Qwen3 model type, dense or MoE, is a Llama-layout decoder, counted by the generic LM
formula (`omniflow.catalog.costs.LM`) with the config defaults its attention implies. The
other Qwen families' LMs (the omni thinkers and talkers, Qwen2.5-VL's language model, the
Qwen-Image text encoder, the tiny TTS talker) are such decoders: their families leave them
to this rule, and a Qwen3 codec talker builds on `QWEN3`.
"""

from __future__ import annotations

from omniflow.catalog.components import LM_CATEGORIES, ComponentConfig
from omniflow.catalog.costs import LM

# Qwen2's attention biases q, k and v but not o (where the config does not say otherwise:
# Qwen2-MoE's `qkv_bias`).
QWEN2 = {"qkv_bias": True}
# Qwen3's RMS-normalises q and k per head (one head_dim weight each); its `attention_bias`
# applies to all four projections, as Llama's.
QWEN3 = {"use_qk_norm": True}
# Qwen3's linear-attention hybrids, which the formula does not cover: their checkpoint
# count serves.
_HYBRIDS = ("qwen3_next", "qwen3_5")


def cost(cfg: ComponentConfig) -> LM | None:
    """The LM formula for a Qwen2 or Qwen3 decoder (by `model_type`); None for anything else."""
    model_type = cfg.config.get("model_type", "")
    if cfg.category not in LM_CATEGORIES or model_type.startswith(_HYBRIDS):
        return None
    if model_type.startswith("qwen2"):
        return LM(cfg, QWEN2)
    if model_type.startswith("qwen3"):
        return LM(cfg, QWEN3)
    return None

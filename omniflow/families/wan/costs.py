"""Wan2.2's cost formula (torch-free; the descriptor's `cost` rule): its video DiT, exactly."""

from __future__ import annotations

from omniflow.catalog.components import ComponentConfig
from omniflow.catalog.costs import (
    NONE,
    DiT,
    Shape,
    attention,
    attention_flops,
    conv,
    elementwise,
    linear,
)

CLASS_NAME = "WanTransformer3DModel"


def cost(cfg: ComponentConfig) -> DiT | None:
    """The video DiT's formula for a WanTransformer3DModel; None for anything else."""
    return VideoDiT(cfg) if cfg.config.get("_class_name") == CLASS_NAME else None


class VideoDiT(DiT):
    """The Wan video DiT (diffusers WanTransformer3DModel).

    Per block: self-attention over the video's tokens (biased q/k/v/o, q and k RMS-normed
    across heads), cross-attention to the text (q and o per video token, k and v per text
    token, k RMS-normed), a GELU MLP, the affine cross-attention norm and the block's
    modulation table. Per video token: the patch embedding (a Conv3d over the patch) and
    the output projection; per text token: the text embedder's two linears and each block's
    cross-attention k/v; per video: the timestep embedding and its 6-way projection — per
    token where the pipeline gives a timestep per token (`expand_timesteps`, Wan2.2-TI2V).
    FLOPs per denoising step of one video (or image): 2 x those MACs + self-attention over
    the video's tokens + cross-attention over the text's. Activations: `DiT`'s.
    """

    item = "denoising step of one video"

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        width, layers = c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"]
        patch = c["patch_size"]
        taps = patch[0] * patch[1] * patch[2]
        ffn, text_dim, freq = c["ffn_dim"], c["text_dim"], c["freq_dim"]
        self_attn = attention(width, width, width, True, True) + elementwise(2 * width)
        cross_q = linear(width, width, True) + linear(width, width, True)  # q, o
        cross_kv = 2 * linear(width, width, True)  # per text token
        block = self_attn + cross_q + elementwise(2 * width)  # cross-attention q/k norms
        block += linear(width, ffn, True) + linear(ffn, width, True)
        block += elementwise(2 * width) if c.get("cross_attn_norm") else NONE
        self.image_token = conv(c["in_channels"], width, taps) + layers * block
        self.image_token += linear(width, c["out_channels"] * taps, True)
        text_embedder = linear(text_dim, width, True) + linear(width, width, True)
        self.text_token = text_embedder + layers * cross_kv
        self.time = linear(freq, width, True) + linear(width, width, True)
        self.time += linear(width, 6 * width, True)
        self.per_token_time = bool(c.get("expand_timesteps"))
        tables = elementwise(layers * 6 * width + 2 * width)
        super().__init__(cfg, self.image_token + self.text_token + self.time + tables)

    def flops(self, s: Shape) -> float:
        text = self.text_tokens(s)
        macs = s.length * self.image_token.macs + text * self.text_token.macs
        macs += self.time.macs * (s.length if self.per_token_time else 1)
        scores = attention_flops(self.layers, self.width, s.length) * s.length
        cross = attention_flops(self.layers, self.width, text) * s.length
        return 2.0 * macs + scores + cross

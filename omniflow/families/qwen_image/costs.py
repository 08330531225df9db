"""Qwen-Image's cost formula (torch-free; the descriptor's `cost` rule): its MMDiT, exactly."""

from __future__ import annotations

from omniflow.catalog.components import ComponentConfig
from omniflow.catalog.costs import DiT, attention, elementwise, linear, table

CLASS_NAME = "QwenImageTransformer2DModel"


def cost(cfg: ComponentConfig) -> DiT | None:
    """The MMDiT's formula for a QwenImageTransformer2DModel; None for anything else."""
    return MMDiT(cfg) if cfg.config.get("_class_name") == CLASS_NAME else None


class MMDiT(DiT):
    """The Qwen-Image MMDiT (diffusers QwenImageTransformer2DModel): `DiT`'s rules, with
    these counts.

    Two streams share joint attention: image tokens go through img_in, to_q/k/v, to_out,
    img_mlp and proj_out; text tokens through txt_norm, txt_in, add_q/k/v, to_add_out and
    txt_mlp. The timestep embedding, img_mod / txt_mod and norm_out apply once per image.
    """

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        width, layers = c["num_attention_heads"] * c["attention_head_dim"], c.get("num_layers", 0)
        patch, joint = c["patch_size"], c["joint_attention_dim"]
        out = c.get("out_channels") or c["in_channels"]
        # Per stream per block: biased q/k/v/out projections, q/k RMSNorms, GELU MLP.
        stream = attention(width, width, width, True, True)
        stream += elementwise(2 * c["attention_head_dim"])
        stream += linear(width, 4 * width, True) + linear(4 * width, width, True)
        self.image_token = linear(c["in_channels"], width, True) + layers * stream
        self.image_token += linear(width, patch * patch * out, True)
        self.text_token = elementwise(joint) + linear(joint, width, True) + layers * stream
        timestep = linear(256, width, True) + linear(width, width, True)
        if c.get("use_additional_t_cond"):
            timestep += table(2 * width)
        modulation = 2 * linear(width, 6 * width, True)
        self.per_image = timestep + layers * modulation + linear(width, 2 * width, True)
        super().__init__(cfg, self.image_token + self.text_token + self.per_image)

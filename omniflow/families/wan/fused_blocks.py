"""Wan2.2's video DiT blocks on fused kernels: what `DiffusionSteps`
(`omniflow.backends.diffusion`) runs on CUDA for each block of each expert, in place of
diffusers' `WanTransformerBlock.forward`, computing the same function. The transformer's own
forward (patch and condition embeddings, the rotary table, the output norm and projection)
still runs as diffusers wrote it, calling these blocks. A guided step's conditional and
unconditional rows are one forward already (the backend batches them as rows).

A block's elementwise work becomes: the self-attention's norm and modulation as one kernel
(`omniflow.kernels.ada_norm`, with Wan's float32 numerics), one q/k/v product, one kernel for
the q/k RMSNorms over all heads, the rotary and the `[B, S, H, Dh]` layout
(`omniflow.kernels.qk_norm_rope`), the attention on the stage's kernel
(`omniflow.backends.dit_blocks`), the gated residual add fused with the cross-attention's
affine norm (as a modulation of scale `w - 1` and shift `b`), the cross-attention (its q/k
norms torch's `RMSNorm`, one kernel each; the text's k and v one product), its residual add
fused with the MLP's modulated norm (gate one), the MLP, and its gated residual add in one
pass (`omniflow.kernels.ada_norm`'s `gated_residual`). In
diffusers' ops that is some forty elementwise kernels with float32 intermediates over the
video's tokens. Weights are not copied: the projections' weights become views of the stacked
matrices.

Blocks outside what Wan2.2 ships run diffusers' forward: an image context (Wan2.1 I2V's
`added_kv_proj_dim`), no norm before the cross-attention (`cross_attn_norm` false), q/k
norms other than `rms_norm_across_heads`, or an attention backend set on diffusers'
processors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock

from omniflow.backends.dit_blocks import Attention, feed_forward, fuse, stack_linears
from omniflow.kernels.ada_norm import ada_norm, gated_residual
from omniflow.kernels.qk_norm_rope import qk_norm_rope


def fusable(block: WanTransformerBlock) -> bool:
    """Whether `block` is the Wan2.2 block the fused forward computes."""
    attn1, attn2 = block.attn1, block.attn2
    return (
        attn2.add_k_proj is None
        and isinstance(block.norm2, FP32LayerNorm)
        and block.norm2.weight is not None
        and all(isinstance(a.norm_q, torch.nn.RMSNorm) for a in (attn1, attn2))
        and all(a.processor._attention_backend is None for a in (attn1, attn2))
    )


class FusedWanBlock:
    """`block`'s forward on fused kernels (in the dtype the block already has: stack after any
    `.to()`, which would split the views again), its attention on `attend`."""

    def __init__(self, block: WanTransformerBlock, attend: Attention | None = None):
        self.block = block
        self.attend = attend or Attention()
        self.fused = fusable(block)
        if not self.fused:
            return
        attn1, attn2 = block.attn1, block.attn2
        self.qkv = stack_linears([attn1.to_q, attn1.to_k, attn1.to_v])
        self.text_kv = stack_linears([attn2.to_k, attn2.to_v])
        # The cross-attention's norm `layernorm * w + b` as a modulation `* (1 + scale) + shift`.
        norm2 = block.norm2
        self.norm2_scale = (norm2.weight.detach().float() - 1)[None]
        self.norm2_shift = norm2.bias.detach().float()[None]
        self.no_gate = torch.ones_like(self.norm2_shift)

    def __call__(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        temb: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        block = self.block
        if not self.fused:
            return type(block).forward(
                block, hidden_states, encoder_hidden_states, temb, rotary_emb
            )
        attn1, attn2 = block.attn1, block.attn2
        batch, tokens, width = hidden_states.shape
        text = encoder_hidden_states.shape[1]
        heads = attn1.heads
        # float32 modulation, [M, D] rows: per batch row (A14B), per token (TI2V's [B, S, 6, D]).
        if temb.ndim == 4:
            mod = (block.scale_shift_table.unsqueeze(0) + temb.float()).unbind(2)
        else:
            mod = (block.scale_shift_table + temb.float()).unbind(1)
        shift, scale, gate, c_shift, c_scale, c_gate = (m.reshape(-1, width) for m in mod)
        x = hidden_states.reshape(batch * tokens, width)

        # Self-attention: norm and modulation; q/k/v; q/k norms, rotary, layout; attention.
        normed, _ = ada_norm(x, shift, scale, eps=block.norm1.eps, round_once=True)
        q, k, v = (x.new_empty(batch, tokens, heads, width // heads) for _ in range(3))
        cos, sin = rotary_emb
        freqs = torch.complex(cos[0, :, 0, 0::2].float(), sin[0, :, 0, 1::2].float())
        qk_norm_rope(
            F.linear(normed, *self.qkv), attn1.norm_q.weight, attn1.norm_k.weight, freqs,
            q, k, v, 0, attn1.norm_q.eps, across_heads=True,
        )  # fmt: skip
        attended = self.attend(q, k, v).reshape(batch * tokens, width)
        attended = attn1.to_out[0](attended)
        normed, x = ada_norm(
            x, self.norm2_shift, self.norm2_scale, attended, gate, eps=block.norm2.eps,
            round_once=True,
        )  # fmt: skip

        # Cross-attention over the text (no rotary, no mask: Wan pads every prompt to 512).
        q = attn2.norm_q(F.linear(normed, attn2.to_q.weight, attn2.to_q.bias))
        k, v = F.linear(encoder_hidden_states, *self.text_kv).chunk(2, dim=-1)
        k = attn2.norm_k(k)
        attended = self.attend(
            q.view(batch, tokens, heads, -1),
            k.view(batch, text, heads, -1),
            v.view(batch, text, heads, -1),
        ).reshape(batch * tokens, width)
        attended = attn2.to_out[0](attended)
        normed, x = ada_norm(
            x, c_shift, c_scale, attended, self.no_gate, eps=block.norm3.eps, round_once=True
        )

        # The MLP and its gated residual add, in float32 as diffusers adds it, in one pass.
        out = gated_residual(x, feed_forward(block.ffn, normed), c_gate, round_once=True)
        return out.view(batch, tokens, width)


def fuse_blocks(transformer: WanTransformer3DModel, attend: Attention | None = None) -> None:
    """Every block of `transformer` forwards on fused kernels from now on."""
    fuse(transformer.blocks, lambda block: FusedWanBlock(block, attend))

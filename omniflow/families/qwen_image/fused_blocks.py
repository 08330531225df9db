"""Qwen-Image's dual-stream MMDiT blocks on fused kernels: what `DiffusionSteps`
(`omniflow.backends.diffusion`) runs on CUDA for each of the transformer's blocks, in place of
diffusers' `QwenImageTransformerBlock.forward`, computing the same function. The
transformer's own forward (patch and text embeddings, timestep embedding, RoPE, the final
norm and projection) still runs as diffusers wrote it, calling these blocks.

A block's elementwise work becomes, per stream: one adaptive LayerNorm (norm and modulation,
`omniflow.kernels.ada_norm`), one q/k/v product, one kernel for the q/k RMSNorms, the
rotary and the joint sequence's concatenation (`omniflow.kernels.qk_norm_rope`), the gated
residual add fused with the second adaptive norm, the MLP (its GELU in the first product's
epilogue: `dit_blocks.feed_forward`), and its gated residual add
(`omniflow.kernels.ada_norm`'s `gated_residual`). In
diffusers' ops that is some forty elementwise kernels with float32 intermediates, which at
1024x1024 move gigabytes a block (docs/benchmarks-log.md, "Fused MMDiT blocks"). Weights are
not copied: the q/k/v modules' weights become views into the stacked matrices.

Blocks that edit (`zero_cond_t`, Qwen-Image-Edit-2511's per-token modulation), take
attention kwargs or run in float16 run diffusers' own forward.

The transformer's forward normalises a padded prompt's mask with diffusers'
`compute_text_seq_len_from_mask`, which builds its fallback length with
`torch.as_tensor(int, device=...)`: a blocking host-to-device copy, a host sync in every
denoising step of a batch with padded prompt rows. `fuse_blocks` puts in its place
`text_seq_len_from_mask`, the same function without that copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.transformers.transformer_qwenimage import (
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
)

from omniflow.backends.dit_blocks import Attention, feed_forward, fuse, stack_linears
from omniflow.kernels.ada_norm import ada_norm, gated_residual
from omniflow.kernels.qk_norm_rope import qk_norm_rope


class FusedQwenImageBlock:
    """`block`'s forward on fused kernels (in the dtype the block already has: stack after
    any `.to()`, which would split the views again), its attention on `attend`."""

    def __init__(self, block: QwenImageTransformerBlock, attend: Attention | None = None):
        self.block = block
        self.attend = attend or Attention()
        attn = block.attn
        self.img_qkv = stack_linears([attn.to_q, attn.to_k, attn.to_v])
        self.txt_qkv = stack_linears([attn.add_q_proj, attn.add_k_proj, attn.add_v_proj])

    def __call__(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict | None = None,
        modulate_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.block
        # float16 too: diffusers clips its outputs to float16's range.
        edits = block.zero_cond_t or modulate_index is not None or joint_attention_kwargs
        if edits or hidden_states.dtype == torch.float16:
            return type(block).forward(
                block, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                image_rotary_emb, joint_attention_kwargs, modulate_index,
            )  # fmt: skip
        attn, eps = block.attn, block.img_norm1.eps
        batch, image, width = hidden_states.shape
        text = encoder_hidden_states.shape[1]
        img_mod = block.img_mod(temb).chunk(6, dim=1)  # shift, scale, gate; twice
        txt_mod = block.txt_mod(temb).chunk(6, dim=1)
        img = hidden_states.reshape(batch * image, width)
        txt = encoder_hidden_states.reshape(batch * text, width)
        img_normed, _ = ada_norm(img, img_mod[0], img_mod[1], eps=eps)
        txt_normed, _ = ada_norm(txt, txt_mod[0], txt_mod[1], eps=eps)

        # The joint sequence, text first, as diffusers concatenates it.
        joint = (batch, text + image, attn.heads, width // attn.heads)
        q, k, v = (img.new_empty(joint) for _ in range(3))
        qk_eps = attn.norm_q.eps
        img_freqs, txt_freqs = image_rotary_emb
        qk_norm_rope(
            F.linear(txt_normed, *self.txt_qkv), attn.norm_added_q.weight,
            attn.norm_added_k.weight, txt_freqs, q, k, v, 0, qk_eps,
        )  # fmt: skip
        qk_norm_rope(
            F.linear(img_normed, *self.img_qkv), attn.norm_q.weight, attn.norm_k.weight,
            img_freqs, q, k, v, text, qk_eps,
        )  # fmt: skip
        mask = None
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones((batch, image), dtype=torch.bool, device=img.device)
            mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
        attended = self.attend(q, k, v, mask)
        img_attn = attn.to_out[0](attended[:, text:].reshape(batch * image, width))
        txt_attn = attn.to_add_out(attended[:, :text].reshape(batch * text, width))

        img_normed, img = ada_norm(img, img_mod[3], img_mod[4], img_attn, img_mod[2], eps=eps)
        txt_normed, txt = ada_norm(txt, txt_mod[3], txt_mod[4], txt_attn, txt_mod[2], eps=eps)
        img = gated_residual(img, feed_forward(block.img_mlp, img_normed), img_mod[5])
        txt = gated_residual(txt, feed_forward(block.txt_mlp, txt_normed), txt_mod[5])
        return txt.view(batch, text, width), img.view(batch, image, width)


def fuse_blocks(transformer: QwenImageTransformer2DModel, attend: Attention | None = None):
    """Every block of `transformer` forwards on fused kernels from now on (and its forward
    normalises a mask without a host sync)."""
    fuse(transformer.transformer_blocks, lambda block: FusedQwenImageBlock(block, attend))
    transformer_qwenimage.compute_text_seq_len_from_mask = text_seq_len_from_mask


def text_seq_len_from_mask(
    encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None
) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
    """diffusers' `compute_text_seq_len_from_mask` (the text length for RoPE, each row's
    length, the mask as bools) with the fallback length a scalar operand, not a tensor
    copied from the host."""
    batch, length = encoder_hidden_states.shape[:2]
    mask = encoder_hidden_states_mask
    if mask is None:
        return length, None, None
    if mask.shape[:2] != (batch, length):
        raise ValueError(
            f"`encoder_hidden_states_mask` shape {mask.shape} must match "
            f"(batch_size, text_seq_len)=({batch}, {length})."
        )
    mask = mask.to(torch.bool)
    positions = torch.arange(length, device=mask.device)
    last = torch.where(mask, positions, 0).max(dim=1).values
    return length, torch.where(mask.any(dim=1), last + 1, length), mask

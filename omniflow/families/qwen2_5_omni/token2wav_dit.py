"""Token2wav's DiT blocks on fused kernels: what `Token2Wav` runs for a pass's 22 blocks and
its final norm on CUDA (`omniflow.families.qwen2_5_omni.token2wav`), in place of
transformers' `DiTDecoderLayer`s, computing the same function.

A block becomes nine launches instead of some forty-seven: one q/k/v product, the first
head's rotary in place (`omniflow.kernels.dit_rope`), attention, the output product, a
gated residual add fused with the next adaptive norm (`omniflow.kernels.ada_norm`), and the
MLP's two products (the GELU in the first's epilogue). Every block's adaLN modulation (and
the final norm's) depends on the pass's time point alone (the same for every row): one
product gives a whole solve's (`modulations`), at its start.

Attention is block-local (`omniflow.kernels.block_attention`): a block sees its own 24-frame
block and, in three layers, one block back or ahead, so each query tile reads only the keys
within that reach, from each position's block (made once a solve from the window layout),
where a mask over the whole window made attention compute every pair of it (20x the pairs
the own-block layers use). Its output is laid out for the output product, so nothing is
transposed. Weights are not copied: the modules' q/k/v and modulation weights become views
into the stacked matrices, so transformers' modules still run and the memory the stage was
budgeted for does not grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniToken2WavDiTModel,
)

from omniflow.backends.dit_blocks import linear_gelu, stack_linears
from omniflow.kernels.ada_norm import ada_norm
from omniflow.kernels.block_attention import block_attention
from omniflow.kernels.dit_rope import rope_first_head


class FusedDiT:
    """The blocks and final norm of `dit` (in the dtype it already has: stack after any
    `.to()`, which would split the views again)."""

    def __init__(self, dit: Qwen2_5OmniToken2WavDiTModel):
        self.blocks = list(dit.transformer_blocks)
        self.heads = dit.num_attention_heads
        self.qkv = [stack_linears([b.attn.to_q, b.attn.to_k, b.attn.to_v]) for b in self.blocks]
        self.modulation = stack_linears(
            [b.attn_norm.linear for b in self.blocks] + [dit.norm_out.linear]
        )
        self.eps = dit.norm_out.norm.eps
        self.reaches = [(b.look_backward_block, b.look_ahead_block) for b in self.blocks]
        self.block_size = dit.block_size

    def modulations(self, time_embeddings: torch.Tensor) -> torch.Tensor:
        """Every block's adaLN modulation and the final norm's `[n, 6 x 22 + 2 chunks]` for
        `n` passes' time embeddings `[n, D]`: one product for all of a solve's passes, whose
        time points are known at its start (the weights, 288 MB at real size, read once a
        solve rather than once a pass)."""
        return F.linear(F.silu(time_embeddings), *self.modulation)

    def __call__(
        self,
        hidden: torch.Tensor,
        modulation: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        blocks: torch.Tensor,
    ) -> torch.Tensor:
        """`norm_out(blocks(hidden))` for `hidden` `[rows, T, D]`, the pass's modulation
        `[1, ...]` (`modulations`: every row's), the rotary `cos`, `sin` `[rows, T, d]` and
        each position's block `[rows, T]` (int32; padding a block of its own, far from every
        real one)."""
        rows, length, width = hidden.shape
        parts = modulation.split(width, dim=1)  # 6 a block (shift, scale, gate x 2), then 2
        cos, sin = (t.reshape(rows * length, -1) for t in rotary)
        h = hidden.reshape(rows * length, width)
        norm, _ = ada_norm(h, parts[0], parts[1], eps=self.eps)
        for index, block in enumerate(self.blocks):
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = parts[
                6 * index : 6 * index + 6
            ]
            qkv = rope_first_head(F.linear(norm, *self.qkv[index]), cos, sin, self.heads)
            q, k, v = qkv.view(rows, length, 3, self.heads, -1).unbind(2)
            back, ahead = self.reaches[index]
            attended = block_attention(q, k, v, blocks, back, ahead, self.block_size)
            attended = block.attn.to_out[0](attended.view(-1, width))
            norm, h = ada_norm(h, shift_mlp, scale_mlp, attended, gate_msa, eps=self.eps)
            after = parts[6 * index + 6 : 6 * index + 8]
            # The next block's attention norm, or the final norm (its chunks: scale, shift).
            shift, scale = after if index + 1 < len(self.blocks) else after[::-1]
            norm, h = ada_norm(h, shift, scale, _mlp(block.ff, norm), gate_mlp, eps=self.eps)
        return norm.view(rows, length, width)


def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
    """A block's `DiTMLP` (its first product, tanh-GELU, dropout, second product) on rows
    `x`; on CUDA the GELU in the first product's epilogue (no pass of its own: 792 launches
    of a window's ~8,600 on an H100)."""
    first, act, _, second = mlp.ff
    if not (x.is_cuda and act.approximate == "tanh"):
        return mlp(x)
    return second(linear_gelu(first, x))

"""A decoder whose hidden states also carry one inner layer's: `TappedDecoder` wraps a
transformers text model (embed_tokens, layers, norm, rotary_emb) so that its
`last_hidden_state` is `[..., 2H]`, the final (normed) state then the output of the layer
it taps. A component whose next stage reads an inner layer (a thinker whose talker accepts
the state of layer k) gives it as its `decoder`: the dynamic path runs its forward, and the
static step (`omniflow.backends.static_decode`) runs the wrapped model's layers and emits
the same `[..., 2H]` rows."""

from __future__ import annotations

import torch
from torch import nn


class TappedDecoder(nn.Module):
    """`text_model` whose `last_hidden_state` also carries the hidden state of `layer`,
    indexed as transformers' `hidden_states` are (0: the input embeddings; k: the output of
    layer k - 1; the layer count or more: the final, normed state)."""

    def __init__(self, text_model: nn.Module, layer: int):
        super().__init__()
        self.text_model = text_model
        self.layer = layer
        self.captured: torch.Tensor | None = None
        if 0 < layer < len(text_model.layers):
            text_model.layers[layer - 1].register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        self.captured = output[0] if isinstance(output, tuple) else output

    def forward(self, inputs_embeds, **kwargs):
        out = self.text_model(inputs_embeds=inputs_embeds, **kwargs)
        final = out.last_hidden_state
        if self.layer == 0:
            tapped = inputs_embeds
        elif self.layer >= len(self.text_model.layers):
            tapped = final
        else:
            tapped, self.captured = self.captured, None
        out.last_hidden_state = torch.cat((final, tapped.to(final.dtype)), dim=-1)
        return out


def untapped(decoder: nn.Module) -> tuple[nn.Module, int | None]:
    """The text model whose layers `decoder` runs, and the layer it taps (None: none)."""
    if isinstance(decoder, TappedDecoder):
        return decoder.text_model, decoder.layer
    return decoder, None

"""Qwen3-Omni's cost formulas (torch-free; the descriptor's `cost` rule), which Qwen3-TTS's
descriptor shares: its checkpoints' talker and decoder have the same architecture.

- `CodecTalker`: a Qwen3 talker (the Qwen3 decoder layout, `omniflow.families.qwen2_lm.costs`)
  with a code predictor that fills each codec frame's other codebooks, costed per frame;
- `Code2Wav`: Qwen3-Omni's Code2Wav and Qwen3-TTS's 12 Hz tokenizer decoder (a
  sliding-window transformer and a ConvNeXt/SnakeBeta upsampling tail).

Both are told by their config keys (`code_predictor_config`; `upsampling_ratios` with
`decoder_dim`): a code2wav config names no model type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omniflow.catalog.components import LM_CATEGORIES, ComponentConfig
from omniflow.catalog.costs import (
    LM,
    Count,
    Estimator,
    Shape,
    Vocoder,
    attention,
    attention_dims,
    attention_flops,
    conv,
    decoder_stack,
    elementwise,
    gated_mlp,
    linear,
    table,
    total,
)
from omniflow.families.qwen2_lm.costs import QWEN3

# Live buffers of a ConvNet's widest stage: the input kept for the residual, the
# activation's output and the conv's output.
_CONV_BUFFERS = 3


def cost(cfg: ComponentConfig) -> Estimator | None:
    """A codec talker or a code2wav decoder of the Qwen3 codec models; None for anything else."""
    c = cfg.config
    if cfg.category in LM_CATEGORIES and "code_predictor_config" in c:
        return CodecTalker(cfg)
    if cfg.category == "vocoder" and "upsampling_ratios" in c and "decoder_dim" in c:
        return Code2Wav(cfg)
    return None


def code_predictor(c: Mapping[str, Any]) -> Count:
    """A Qwen3 codec talker's code predictor, per codec frame.

    A small dense LM that predicts codebooks 1..G-1 of each frame from the talker's hidden
    state: G-1 code embeddings of the talker's width, G-1 heads, and a projection when the
    talker is wider than the predictor. Per frame it runs over G positions (the talker
    hidden plus G-1 codes) and applies each head once, so its MACs exceed its parameters.
    """
    cp = {**QWEN3, **c["code_predictor_config"]}
    groups = c.get("num_code_groups") or cp["num_code_groups"]
    talker, width, vocab = c["hidden_size"], cp["hidden_size"], cp["vocab_size"]
    per_position = decoder_stack(cp)
    if talker != width:
        per_position += linear(talker, width, bias=True)
    heads = (groups - 1) * linear(width, vocab)
    embeddings = table((groups - 1) * vocab * talker)
    frame = Count(per_position.params, per_position.active, groups * per_position.macs)
    return frame + heads + embeddings


class CodecTalker(LM):
    """A Qwen3 codec talker: the LM formula plus its `code_predictor`, per codec frame (its
    FLOPs the talker's over one position and the code predictor's over its G)."""

    item = "codec frame"

    def __init__(self, cfg: ComponentConfig):
        super().__init__(cfg, QWEN3)

    def formula(self, c: Mapping[str, Any], category: str) -> Count:
        return super().formula(c, category) + code_predictor(c)


def _snake_decoder(c: Mapping[str, Any], width: int) -> tuple[list[tuple[Count, int]], int]:
    """The upsampling tail: ConvNeXt upsampling stages, then SnakeBeta residual stages.

    Returns pieces as (count, positions per codec frame at which its MACs run) and the
    peak elements per frame of any stage. Transposed convs run at their input positions,
    convs at their output positions.
    """
    pieces: list[tuple[Count, int]] = []
    positions, peak = 1, 0
    for ratio in c.get("upsampling_ratios", ()):
        pieces.append((conv(width, width, ratio), positions))
        positions *= ratio
        convnext = conv(width, width, 7, groups=width) + elementwise(2 * width)  # + LayerNorm
        convnext += linear(width, 4 * width, True) + linear(4 * width, width, True)
        pieces.append((convnext + elementwise(width), positions))  # + gamma
        peak = max(peak, 4 * width * positions)
    dim = c["decoder_dim"]
    pieces.append((conv(width, dim, 7), positions))
    peak = max(peak, dim * positions)
    for i, rate in enumerate(c["upsample_rates"]):
        c_in, c_out = dim // 2**i, dim // 2 ** (i + 1)
        pieces.append((elementwise(2 * c_in) + conv(c_in, c_out, 2 * rate), positions))
        positions *= rate
        # Three residual units (dilations 1, 3, 9): SnakeBeta, conv k7, SnakeBeta, conv k1.
        unit = elementwise(4 * c_out) + conv(c_out, c_out, 7) + conv(c_out, c_out, 1)
        pieces.append((3 * unit, positions))
        peak = max(peak, c_out * positions)
    last = dim // 2 ** len(c["upsample_rates"])
    pieces.append((elementwise(2 * last) + conv(last, 1, 7), positions))
    return pieces, peak


def _code2wav(c: Mapping[str, Any]) -> tuple[list[tuple[Count, int]], int]:
    """(pieces, peak elements per frame) of a code2wav decoder.

    Codes enter through summed embeddings (Qwen3-Omni) or a split residual VQ with 1x1
    projections and a causal conv (Qwen3-TTS, whose transformer is narrower and projects
    in and out); then a sliding-window transformer with layer scales and the ConvNet tail.
    """
    hidden = c["hidden_size"]
    bias = c.get("attention_bias", False)
    _, q_dim, kv_dim = attention_dims(c)
    attn = attention(hidden, q_dim, kv_dim, bias, bias)  # no q/k norms
    # Two RMSNorms and two layer scales per layer.
    layer = attn + gated_mlp(hidden, c["intermediate_size"]) + elementwise(4 * hidden)
    transformer = c["num_hidden_layers"] * layer + elementwise(hidden)
    codebooks = c["num_quantizers"] * c["codebook_size"]
    if "codebook_dim" in c:
        dim, width = c["codebook_dim"], c["latent_dim"]
        # Semantic and acoustic RVQs: half-width codebooks (an embedding_sum plus a
        # cluster_usage entry per code) between 1x1 projections; decoding runs only the
        # output projections, the input ones serve encoding.
        front = table(codebooks * (dim // 2 + 1) + 2 * dim * (dim // 2))
        front += 2 * conv(dim // 2, dim, 1, bias=False) + conv(dim, width, 3)
        transformer += linear(width, hidden, True) + linear(hidden, width, True)
    else:
        width = hidden
        front = table(codebooks * hidden)
    tail, peak = _snake_decoder(c, width)
    return [(front + transformer, 1), *tail], peak


class Code2Wav(Vocoder):
    """Exact parameters; FLOPs per frame = 2 x each piece's MACs x its positions per frame +
    sliding-window attention; activations = the widest stage's peak elements per frame x
    `_CONV_BUFFERS`."""

    def __init__(self, cfg: ComponentConfig):
        self.pieces, peak = _code2wav(cfg.config)
        super().__init__(cfg, total(p for p, _ in self.pieces))
        self.elements_per_frame = peak * _CONV_BUFFERS

    def flops(self, s: Shape) -> float:
        c = self.c
        window = min(c.get("sliding_window") or s.length, s.length)
        _, q_dim, _ = attention_dims(c)
        macs = sum(p.macs * positions for p, positions in self.pieces)
        return 2.0 * macs + attention_flops(c["num_hidden_layers"], q_dim, window)

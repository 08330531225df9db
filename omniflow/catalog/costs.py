"""Memory and compute estimates for one stage, from its component's configuration.

`estimate_cost(cfg, max_batch=, max_len=)` returns a `StageCost`: parameters, weight bytes,
KV-cache bytes, a peak activation workspace and FLOPs per item. Parameter counts come from
architecture formulas where omniflow has one, each exact against the transformers /
diffusers classes (tests/catalog instantiates them): the generic ones here (Llama-layout
decoder and MoE LMs, diffusers' AutoencoderKL) and a model family's own, which its
descriptor's `cost` rule returns (`omniflow.families.Family`: its DiT, its vocoder, the
layout of its decoders), written in this module's counting pieces (`Count`, `linear`,
`attention`, `decoder_stack`, ...) as an `Estimator`, usually one extending a category's
generic one (`LM`, `DiT`, `Vocoder`). Other components use the count the catalog carries
(`num_parameters`, from a checkpoint header or the builtin catalog), and LM components add
the modules riding along with them (`extra_parameters`). `with_encoder(cost, encoder)` adds
a model a stage runs once per request besides its own (an edit pipeline's denoiser encoding
the input image with the VAE).

FLOPs are 2 per multiply-accumulate of a matmul or conv weight (biases, norms, gates and
activations are not charged, as torch's FlopCounterMode does not charge them), plus the
attention score and value products.

What `max_len` means depends on the component's category:

- decoder/MoE LMs: prompt tokens per sequence (its KV cache holds `cache_len`: the prompt
  and what it generates);
- text, vision and audio encoders: tokens (or patches, audio frames) per input;
- DiT: image tokens per image (`ComponentConfig.image_tokens(height, width)`, plus an edit
  pipeline's input-image tokens);
- VAE: latent positions per image ((height / scale) * (width / scale));
- vocoders: codec frames per request; a forward covers at most `VOCODER_FORWARD_FRAMES`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from omniflow import families
from omniflow.catalog.components import LM_CATEGORIES, ComponentConfig
from omniflow.dtypes import dtype_bytes
from omniflow.errors import ModelConfigError
from omniflow.ir.kinds import PREFILL_TOKENS

# Text tokens a DiT attends to beside the image when neither caller nor config says.
DIT_TEXT_TOKENS = 512
# Frames one vocoder forward decodes: a chunked decode's 300-frame chunk plus its 25 frames
# of left context, as the published codec decoders' reference code chunks it.
VOCODER_FORWARD_FRAMES = 325
# transformers' own decoders of the layout `LM` counts (q/k/v/o attention, gated MLP or
# experts, RMSNorms): Llama's is that layout, its config naming each bias (attention_bias,
# mlp_bias); Mistral's differs only in how far attention reaches (sliding_window), which no
# weight depends on. Any other model type of the layout is its family's to declare (its
# `cost` rule returns an `LM` with the config defaults its layout implies).
LLAMA_LAYOUT = ("llama", "mistral")
# Sampling reads the logits in float32.
_LOGIT_BYTES = 4
# Fallback activation of a vocoder without a structural formula, in elements per output
# sample: BigVGAN-style decoders hold ~24 channels per sample at every upsampling stage,
# with up to ~5 live buffers (multi-receptive-field branches summed).
_VOCODER_ELEMENTS_PER_SAMPLE = 128
# Fallback activation of a VAE without a formula, in buffers of its full-resolution stage.
_VAE_FULL_RES_BUFFERS = 4


@dataclass(frozen=True)
class StageCost:
    """One stage replica's memory and compute at its maximum batch.

    params: every parameter the stage loads (an LM component includes the modules listed in
        its config's `extra_parameters`, e.g. a thinker's audio and vision towers).
    active_params: distinct parameters one item touches (MoE: only the routed experts and
        the shared expert; LMs: without the input embedding lookup; a codec LM: per frame,
        its code predictor included).
    params_source: "formula", "formula+counts" (formula plus counted extras) or "count"
        (the config's `num_parameters`).
    weight_bytes: params x bytes of the dtype.
    kv_bytes_per_token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes for
        decoder/MoE LMs; 0 for everything else (a codec LM's per-frame code-predictor cache
        is transient).
    kv_cache_bytes: max_batch x cache_len (default max_len) x kv_bytes_per_token.
    activation_bytes: peak workspace at max_batch; see each family's estimator.
    flops_per_item: forward FLOPs per `item`.
    item: the unit of flops_per_item: "token", "codec frame", "denoising step of one
        image" or "image".
    """

    params: int
    active_params: int
    params_source: str
    weight_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    activation_bytes: int
    flops_per_item: float
    item: str

    @property
    def total_bytes(self) -> int:
        """Weights + KV cache + activations."""
        return self.weight_bytes + self.kv_cache_bytes + self.activation_bytes


def with_encoder(cost: StageCost, encoder: StageCost) -> StageCost:
    """`cost` for a stage that also runs `encoder` once per request, before and apart from its
    own forwards (an edit pipeline's denoiser VAE-encoding its input image): both weights,
    the larger of the two workspaces (they are never live at once), and the stage's own FLOPs
    per item (the encoder's are once per request, not per item)."""
    if encoder.params_source == "formula" or cost.params_source == "count":
        source = cost.params_source
    else:
        source = "formula+counts"
    return replace(
        cost,
        params=cost.params + encoder.params,
        params_source=source,
        weight_bytes=cost.weight_bytes + encoder.weight_bytes,
        activation_bytes=max(cost.activation_bytes, encoder.activation_bytes),
    )


def count_parameters(cfg: ComponentConfig) -> int:
    """Parameters the component loads (see StageCost.params)."""
    return _estimator(cfg).count.params


def estimate_cost(
    cfg: ComponentConfig,
    *,
    max_batch: int,
    max_len: int,
    dtype: str | None = None,
    prefill_tokens: int | None = None,
    context_len: int | None = None,
    cache_len: int | None = None,
) -> StageCost:
    """Estimate one stage replica serving `cfg` at `max_batch` items of `max_len` each.

    `dtype` overrides the component's own (weights, KV cache and activations alike).
    `prefill_tokens` (LMs) is the prompt positions one prefill forward batches (default
    PREFILL_TOKENS); a forward holds that or one max_len prompt, whichever is more, and no
    more than max_batch x max_len. `context_len` (DiT) is the
    text tokens per image; default: the config's max_text_len, else DIT_TEXT_TOKENS.
    `cache_len` (LMs) is the positions one item's KV cache holds: its prompt and what it
    generates (default max_len).
    """
    if max_batch < 1 or max_len < 1:
        raise ModelConfigError(f"max_batch and max_len must be >= 1, got {max_batch}, {max_len}")
    est = _estimator(cfg)
    try:
        nbytes = dtype_bytes(dtype or cfg.dtype)
    except ValueError as err:  # the dtype came from the model config or the stage: theirs
        raise ModelConfigError(str(err)) from None
    shape = Shape(max_batch, max_len, nbytes, prefill_tokens, context_len)
    kv_per_token = est.kv_bytes_per_token(nbytes)
    return StageCost(
        params=est.count.params,
        active_params=est.count.active,
        params_source=est.source,
        weight_bytes=est.count.params * nbytes,
        kv_bytes_per_token=kv_per_token,
        kv_cache_bytes=max_batch * (cache_len or max_len) * kv_per_token,
        activation_bytes=int(est.activation_bytes(shape)),
        flops_per_item=float(est.flops(shape)),
        item=est.item,
    )


# --- counting pieces ----------------------------------------------------------------------


@dataclass(frozen=True)
class Count:
    """Parameters, the share one item touches, and multiply-accumulates per application.

    Only matmul and conv weights carry MACs; biases, norms, layer scales, SnakeBeta and
    lookup tables are parameters without MACs.
    """

    params: int = 0
    active: int = 0
    macs: int = 0

    def __add__(self, other: Count) -> Count:
        return Count(self.params + other.params, self.active + other.active, self.macs + other.macs)

    def __mul__(self, n: int) -> Count:
        return Count(self.params * n, self.active * n, self.macs * n)

    __rmul__ = __mul__


NONE = Count()


def total(counts) -> Count:
    return sum(counts, NONE)


def elementwise(n: int) -> Count:
    """Per-channel weights: norms, layer scales, SnakeBeta alpha/beta, biases."""
    return Count(n, n, 0)


def table(n: int) -> Count:
    """A lookup table (embeddings, codebooks): loaded, but no item multiplies it."""
    return Count(n, 0, 0)


def linear(n_in: int, n_out: int, bias: bool = False) -> Count:
    w = n_in * n_out
    return Count(w, w, w) + (elementwise(n_out) if bias else NONE)


def conv(c_in: int, c_out: int, taps: int, groups: int = 1, bias: bool = True) -> Count:
    """A conv or transposed conv with `taps` kernel positions (MACs per position it runs at)."""
    return linear(c_in * taps // groups, c_out, bias)


def gated_mlp(hidden: int, inter: int, bias: bool = False) -> Count:
    """gate_proj, up_proj, down_proj (SwiGLU)."""
    return 2 * linear(hidden, inter, bias) + linear(inter, hidden, bias)


def attention_dims(c: Mapping[str, Any]) -> tuple[int, int, int]:
    """(head_dim, q width, k/v width) of a transformer config."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return head_dim, c["num_attention_heads"] * head_dim, kv_heads * head_dim


def attention(hidden: int, q_dim: int, kv_dim: int, qkv_bias: bool, o_bias: bool) -> Count:
    """q, k, v and o projections."""
    qkv = linear(hidden, q_dim, qkv_bias) + 2 * linear(hidden, kv_dim, qkv_bias)
    return qkv + linear(q_dim, hidden, o_bias)


def _token_workspace(width: int, q_dim: int, kv_dim: int, ffn: int) -> int:
    """Elements one token holds in a transformer layer, counted as if all were live at once.

    Residual + normed input (2 x width), q / k / v / attention output, and gate, up and
    their product in the MLP (3 x ffn). Attention is assumed fused (SDPA or flash): no
    L x L score matrix.
    """
    return 2 * width + 2 * q_dim + 2 * kv_dim + 3 * ffn


def attention_flops(layers: int, q_dim: int, context: int) -> float:
    """QK^T and AV for one query over `context` keys, all layers: 2 matmuls x 2 FLOPs/MAC."""
    return 4.0 * layers * q_dim * context


# --- estimators ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """What an estimate is for: `estimate_cost`'s batch, length, dtype bytes and sizes."""

    batch: int
    length: int
    nbytes: int
    prefill_tokens: int | None
    context_len: int | None


class Estimator(ABC):
    """A component's parameter count (`source`: "formula", "formula+counts" or "count") plus
    its activation and FLOP rules: what a family's `cost` rule returns."""

    item = "token"

    def __init__(self, cfg: ComponentConfig, count: Count, source: str):
        self.cfg = cfg
        self.c = cfg.config
        self.count = count
        self.source = source

    def kv_bytes_per_token(self, nbytes: int) -> int:
        return 0

    @abstractmethod
    def activation_bytes(self, s: Shape) -> float:
        """Peak workspace bytes at the stage's batch."""

    @abstractmethod
    def flops(self, s: Shape) -> float:
        """FLOPs per item (`item` says what an item is)."""


def _estimator(cfg: ComponentConfig) -> Estimator:
    """A model family's formula where its `cost` rule has one (the families that know the
    component's architectures are asked first, then the others: a bare config names none),
    else the category's generic rule."""
    known = families.knowing(cfg.architectures)
    for family in known + [f for f in families.families() if f not in known]:
        estimator = family.cost(cfg) if family.cost is not None else None
        if estimator is not None:
            return estimator
    category = cfg.category
    if category in LM_CATEGORIES:
        return LM(cfg, {} if cfg.config.get("model_type") in LLAMA_LAYOUT else None)
    if category in ("vision_encoder", "audio_encoder"):
        return _Encoder(cfg)
    if category == "dit":
        return DiT(cfg)
    if category == "vae":
        return _VAE(cfg)
    if category == "vocoder":
        return Vocoder(cfg)
    raise ModelConfigError(f"{_name(cfg)}: no cost rules for a {category}")


def _name(cfg: ComponentConfig) -> str:
    return f"{cfg.model}" + (f" [{cfg.component}]" if cfg.component else "")


def _counted(cfg: ComponentConfig, what: str) -> Count:
    """The config's parameter count, for components no formula covers; every weight is
    taken as touched once per item position."""
    n = cfg.config.get("num_parameters")
    if not n:
        raise ModelConfigError(
            f"{_name(cfg)}: no parameter formula for {what} and no parameter count: the model "
            "directory has no safetensors checkpoint and the builtin catalog has no count "
            "(set config['num_parameters'])"
        )
    return Count(n, n, n)


# --- decoder LMs (dense and MoE), text encoders, codec LMs ---------------------------------


def _lm_attention(c: Mapping[str, Any]) -> Count:
    """q/k/v/o with the config's biases (`qkv_bias`: q, k and v only; else `attention_bias`
    on all four), and per-head q/k RMSNorms (one head_dim weight each) if `use_qk_norm`."""
    head_dim, q_dim, kv_dim = attention_dims(c)
    if "qkv_bias" in c:
        qkv_bias, o_bias = c["qkv_bias"], False
    else:
        qkv_bias = o_bias = c.get("attention_bias", False)
    count = attention(c["hidden_size"], q_dim, kv_dim, qkv_bias, o_bias)
    return count + (elementwise(2 * head_dim) if c.get("use_qk_norm") else NONE)


def _is_sparse(c: Mapping[str, Any], layer: int) -> bool:
    """transformers' MoE layer rule (`mlp_only_layers`, `decoder_sparse_step`)."""
    return (
        c.get("num_experts", 0) > 0
        and layer not in (c.get("mlp_only_layers") or [])
        and (layer + 1) % c.get("decoder_sparse_step", 1) == 0
    )


def _lm_mlp(c: Mapping[str, Any], layer: int) -> Count:
    """One layer's MLP, or its MoE block: all experts loaded, top-k of them touched."""
    hidden = c["hidden_size"]
    if not _is_sparse(c, layer):
        return gated_mlp(hidden, c["intermediate_size"], c.get("mlp_bias", False))
    expert = gated_mlp(hidden, c["moe_intermediate_size"])
    routed = Count(
        c["num_experts"] * expert.params,
        c["num_experts_per_tok"] * expert.active,
        c["num_experts_per_tok"] * expert.macs,
    )
    router = linear(hidden, c["num_experts"])
    if c.get("shared_expert_intermediate_size"):
        # A shared expert beside the routed ones, and its sigmoid gate Linear(hidden, 1).
        shared = gated_mlp(hidden, c["shared_expert_intermediate_size"]) + linear(hidden, 1)
        return routed + router + shared
    return routed + router


def decoder_stack(c: Mapping[str, Any]) -> Count:
    """A Llama-layout decoder's layers and final norm, without embeddings or head."""
    hidden = c["hidden_size"]
    norms = elementwise(2 * hidden)  # input and post-attention RMSNorms
    layers = total(
        _lm_attention(c) + _lm_mlp(c, layer) + norms for layer in range(c["num_hidden_layers"])
    )
    return layers + elementwise(hidden)


class LM(Estimator):
    """Decoder LMs (dense or MoE), text encoders and codec LMs.

    With a `layout` (config defaults of a Llama-layout decoder: {} for `LLAMA_LAYOUT`'s, a
    family's for its model types, e.g. q/k/v biases) counted by `formula`; without, the
    config's `num_parameters` (a checkpoint count), every weight taken as touched per token.
    Formula params: embeddings (vocab x embedding_size) + `decoder_stack` [q/k/v/o with the
    config's biases, q/k norms if `use_qk_norm`, gated MLP or experts + router (+ shared
    expert), two RMSNorms] + final norm + lm_head unless tied (+ what a family's subclass
    adds: a codec LM's code predictor) + the config's extra_parameters. FLOPs per token (per
    frame for a codec LM): 2 x MACs of the active weights (the lm_head included except for
    text encoders, which stop at hidden states) + attention over max_len keys.
    """

    def __init__(self, cfg: ComponentConfig, layout: Mapping[str, Any] | None = None):
        c = cfg.config
        _, self.q_dim, self.kv_dim = attention_dims(c)
        if layout is None:
            model_type = c.get("model_type", "")
            super().__init__(cfg, _counted(cfg, f"model_type '{model_type}'"), "count")
            return
        extras = sum(c.get("extra_parameters", {}).values())
        count = self.formula({**layout, **c}, cfg.category) + table(extras)
        super().__init__(cfg, count, "formula+counts" if extras else "formula")

    def formula(self, c: Mapping[str, Any], category: str) -> Count:
        """Embeddings, decoder stack and head of config `c` (the layout's defaults merged)."""
        hidden, vocab = c["hidden_size"], c["vocab_size"]
        head = linear(hidden, vocab)
        if category == "text_encoder":
            head = table(head.params)
        if c.get("tie_word_embeddings"):
            head = Count(0, head.active, head.macs)
        return table(vocab * c.get("embedding_size", hidden)) + decoder_stack(c) + head

    def kv_bytes_per_token(self, nbytes: int) -> int:
        if self.cfg.category == "text_encoder":
            return 0
        return 2 * self.c["num_hidden_layers"] * self.kv_dim * nbytes

    def _ffn_width(self) -> int:
        """MLP width one token occupies: routed experts' plus shared expert's for MoE."""
        c = self.c
        if c.get("num_experts", 0) > 0:
            # Mixtral-style configs size their experts with intermediate_size.
            expert = c.get("moe_intermediate_size") or c["intermediate_size"]
            routed = c["num_experts_per_tok"] * expert
            return routed + c.get("shared_expert_intermediate_size", 0)
        # GPT-2-style configs leave the MLP width implicit at 4 x hidden.
        return c.get("intermediate_size") or 4 * c["hidden_size"]

    def activation_bytes(self, s: Shape) -> float:
        """One forward's layer workspace plus float32 logits for the batch.

        LMs: the larger of a prefill of `prefill_tokens` and a decode step of max_batch
        tokens (logits of the last position only, as generate() computes them). Text
        encoders: all max_batch x max_len prompt tokens at once, no logits.
        """
        hidden = self.c["hidden_size"]
        per_token = _token_workspace(hidden, self.q_dim, self.kv_dim, self._ffn_width())
        if self.cfg.category == "text_encoder":
            return s.batch * s.length * per_token * s.nbytes
        prefill = max(s.prefill_tokens or PREFILL_TOKENS, s.length)
        tokens = max(min(prefill, s.batch * s.length), s.batch)
        return tokens * per_token * s.nbytes + s.batch * self.c["vocab_size"] * _LOGIT_BYTES

    def flops(self, s: Shape) -> float:
        scores = attention_flops(self.c["num_hidden_layers"], self.q_dim, s.length)
        return 2.0 * self.count.macs + scores


# --- vision and audio encoders ----------------------------------------------------------


class _Encoder(Estimator):
    """Vision and audio towers: the catalog's parameter count (no formula).

    FLOPs per token: 2 x params (every weight taken as a linear applied once per token; the
    patch and conv stems are a small share) + attention over the input's max_len tokens.
    Activations: max_batch x max_len tokens of layer workspace.
    """

    def __init__(self, cfg: ComponentConfig):
        super().__init__(cfg, _counted(cfg, cfg.category.replace("_", " ")), "count")
        self.width = self._first("hidden_size", "d_model")
        self.layers = self._first("depth", "encoder_layers", "num_hidden_layers")
        self.ffn = self._first("intermediate_size", "encoder_ffn_dim")

    def _first(self, *keys: str) -> int:
        """The first of `keys` the config sets: vision and audio towers name dims differently."""
        for key in keys:
            if self.c.get(key):
                return self.c[key]
        raise ModelConfigError(f"{_name(self.cfg)}: config sets none of {', '.join(keys)}")

    def activation_bytes(self, s: Shape) -> float:
        per_token = _token_workspace(self.width, self.width, self.width, self.ffn)
        return s.batch * s.length * per_token * s.nbytes

    def flops(self, s: Shape) -> float:
        return 2.0 * self.count.macs + attention_flops(self.layers, self.width, s.length)


# --- diffusion transformers -------------------------------------------------------------


class DiT(Estimator):
    """A DiT denoising max_batch images of max_len image tokens, each beside its text tokens
    (`context_len`; default: the config's max_text_len, else DIT_TEXT_TOKENS).

    A family's formula (a subclass its `cost` rule returns) gives `count` and the MACs per
    image token, per text token and per image; FLOPs per denoising step of one image: 2 x
    (image tokens x image-token MACs + text tokens x text-token MACs + per-image MACs) +
    joint attention over image + text tokens. Without one: the catalog's count, every
    weight applied to every token. Activations: max_batch x (image + text tokens) x
    (residual, normed, q/k/v/out and the 4x MLP hidden before and after GELU = 14 x width)
    elements. A CFG pair counts as two in max_batch.
    """

    item = "denoising step of one image"
    per_image = NONE

    def __init__(self, cfg: ComponentConfig, count: Count | None = None):
        c = cfg.config
        self.width = c["num_attention_heads"] * c["attention_head_dim"]
        self.layers = c.get("num_layers", 0)
        if count is not None:
            super().__init__(cfg, count, "formula")
            return
        count = _counted(cfg, f"DiT class {c.get('_class_name')}")
        self.image_token = self.text_token = count
        super().__init__(cfg, count, "count")

    def text_tokens(self, s: Shape) -> int:
        return s.context_len or self.c.get("max_text_len") or DIT_TEXT_TOKENS

    def activation_bytes(self, s: Shape) -> float:
        tokens = s.length + self.text_tokens(s)
        return s.batch * tokens * 14 * self.width * s.nbytes

    def flops(self, s: Shape) -> float:
        text = self.text_tokens(s)
        macs = s.length * self.image_token.macs + text * self.text_token.macs
        tokens = s.length + text
        scores = attention_flops(self.layers, self.width, tokens) * tokens
        return 2.0 * (macs + self.per_image.macs) + scores


# --- VAEs -------------------------------------------------------------------------------


def _resnet(c_in: int, c_out: int) -> Count:
    """diffusers ResnetBlock2D without time embedding: 2 GroupNorms, 2 3x3 convs, 1x1 shortcut."""
    shortcut = conv(c_in, c_out, 1) if c_in != c_out else NONE
    norms = elementwise(2 * c_in + 2 * c_out)
    return norms + conv(c_in, c_out, 9) + conv(c_out, c_out, 9) + shortcut


def _mid_block(channels: int, with_attention: bool) -> Count:
    """UNetMidBlock2D: two resnets around one single-head attention (GroupNorm, q, k, v, out)."""
    resnets = 2 * _resnet(channels, channels)
    if not with_attention:
        return resnets
    return resnets + elementwise(2 * channels) + 4 * linear(channels, channels, True)


def _autoencoder_kl(c: Mapping[str, Any]) -> tuple[Count, list[tuple[Count, int]]]:
    """diffusers AutoencoderKL: (encoder + quant conv, decoder pieces as (count, area)).

    The area is the number of output positions per latent position at which the piece
    runs during decode (1 at latent resolution, 4 after one 2x upsampling, ...).
    """
    chans, per_block = list(c["block_out_channels"]), c["layers_per_block"]
    z, with_attention = c["latent_channels"], c.get("mid_block_add_attention", True)
    encoder = conv(c["in_channels"], chans[0], 9)
    prev = chans[0]
    for i, out in enumerate(chans):
        encoder += total(_resnet(prev if j == 0 else out, out) for j in range(per_block))
        if i < len(chans) - 1:
            encoder += conv(out, out, 9)  # Downsample2D
        prev = out
    encoder += _mid_block(chans[-1], with_attention)
    encoder += elementwise(2 * chans[-1]) + conv(chans[-1], 2 * z, 9)
    if c.get("use_quant_conv", True):
        encoder += conv(2 * z, 2 * z, 1)
    pieces = [(conv(z, chans[-1], 9) + _mid_block(chans[-1], with_attention), 1)]
    if c.get("use_post_quant_conv", True):
        pieces.append((conv(z, z, 1), 1))
    prev = chans[-1]
    for i, out in enumerate(reversed(chans)):
        resnets = total(_resnet(prev if j == 0 else out, out) for j in range(per_block + 1))
        pieces.append((resnets, 4**i))
        if i < len(chans) - 1:
            pieces.append((conv(out, out, 9), 4 ** (i + 1)))  # Upsample2D: 2x nearest, conv
        prev = out
    full_res = elementwise(2 * chans[0]) + conv(chans[0], c["out_channels"], 9)
    pieces.append((full_res, 4 ** (len(chans) - 1)))
    return encoder, pieces


def _block_types_supported(c: Mapping[str, Any]) -> bool:
    down = set(c.get("down_block_types", ())) <= {"DownEncoderBlock2D"}
    return down and set(c.get("up_block_types", ())) <= {"UpDecoderBlock2D"}


class _VAE(Estimator):
    """A VAE decoding max_batch images of max_len latent positions each.

    diffusers AutoencoderKL (with the standard Down/UpDecoderBlock2D): exact parameters;
    decode FLOPs = 2 x each decoder piece's MACs x the positions it runs at, plus the
    mid-block attention over all latent positions. Other VAEs: the catalog's count, and
    FLOPs of `flops_per_position` x positions when the catalog measured it, else the lower
    bound 2 x params x positions. Activations: the full-resolution decoder stage's
    `_VAE_FULL_RES_BUFFERS` feature maps (channels x pixels).
    """

    item = "image"

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        self.pieces: list[tuple[Count, int]] | None = None
        if c.get("_class_name") == "AutoencoderKL" and _block_types_supported(c):
            encoder, self.pieces = _autoencoder_kl(c)
            super().__init__(cfg, encoder + total(p for p, _ in self.pieces), "formula")
        else:
            super().__init__(cfg, _counted(cfg, f"VAE class {c.get('_class_name')}"), "count")
        self.scale = cfg.vae_scale_factor or 1
        if "block_out_channels" in c:
            self.full_res_channels = c["block_out_channels"][0]
        else:
            self.full_res_channels = c["base_dim"] * c["dim_mult"][0]

    def activation_bytes(self, s: Shape) -> float:
        pixels = s.length * self.scale**2
        return s.batch * pixels * self.full_res_channels * _VAE_FULL_RES_BUFFERS * s.nbytes

    def flops(self, s: Shape) -> float:
        if self.pieces is None:
            return (self.c.get("flops_per_position") or 2.0 * self.count.macs) * s.length
        macs = sum(p.macs * area for p, area in self.pieces) * s.length
        scores = 0.0
        if self.c.get("mid_block_add_attention", True):
            scores = attention_flops(1, self.c["block_out_channels"][-1], s.length) * s.length
        return 2.0 * macs + scores


# --- vocoders ---------------------------------------------------------------------------


class Vocoder(Estimator):
    """Codec frames to waveform; a forward decodes at most VOCODER_FORWARD_FRAMES frames per
    request.

    A family's formula (a subclass its `cost` rule returns) gives `count`, its
    `elements_per_frame` and FLOPs. Without one: the catalog's count and measured
    `flops_per_frame`, else the lower bound 2 x params; activations from
    `_VOCODER_ELEMENTS_PER_SAMPLE`.
    """

    item = "codec frame"

    def __init__(self, cfg: ComponentConfig, count: Count | None = None):
        if count is not None:
            super().__init__(cfg, count, "formula")
            return
        super().__init__(cfg, _counted(cfg, "this vocoder"), "count")
        self.elements_per_frame = _VOCODER_ELEMENTS_PER_SAMPLE * (cfg.samples_per_frame or 1)

    def activation_bytes(self, s: Shape) -> float:
        frames = min(s.length, VOCODER_FORWARD_FRAMES)
        return s.batch * frames * self.elements_per_frame * s.nbytes

    def flops(self, s: Shape) -> float:
        return self.c.get("flops_per_frame") or 2.0 * self.count.macs

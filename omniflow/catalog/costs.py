"""Memory and compute estimates for one stage, from its component's configuration.

`estimate_cost(cfg, max_batch=, max_len=)` returns a `StageCost`: parameters, weight bytes,
KV-cache bytes, a peak activation workspace and FLOPs per item. Parameter counts come from
architecture formulas where omniflow has one (decoder and MoE LMs, text encoders, the
Qwen-Image MMDiT, diffusers' AutoencoderKL, the Qwen3 code2wav ConvNet family); each is
exact against the transformers / diffusers classes (tests/catalog instantiates them). Other
components use the count the catalog carries (`num_parameters`, from a checkpoint header
or the builtin catalog), and LM components add the modules riding along with them
(`extra_parameters`). `with_encoder(cost, encoder)` adds a model a stage runs once per
request besides its own (an edit pipeline's denoiser encoding the input image with the VAE).

FLOPs are 2 per multiply-accumulate of a matmul or conv weight (biases, norms, gates and
activations are not charged, as torch's FlopCounterMode does not charge them), plus the
attention score and value products.

What `max_len` means depends on the component's category:

- decoder/MoE LMs: tokens per sequence (the KV cache length);
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

from omniflow.catalog.components import LM_CATEGORIES, ComponentConfig
from omniflow.dtypes import dtype_bytes
from omniflow.errors import ModelConfigError
from omniflow.ir.kinds import PREFILL_TOKENS

# Text tokens a DiT attends to beside the image when neither caller nor config says.
DIT_TEXT_TOKENS = 512
# Frames one vocoder forward decodes: the reference chunked_decode's 300-frame chunk plus
# its 25 frames of left context (Qwen3 code2wav, Qwen3-TTS, Qwen2.5-Omni token2wav).
VOCODER_FORWARD_FRAMES = 325
# model_type prefixes of Llama-layout decoders (q/k/v/o attention, gated MLP or experts,
# RMSNorms), which the LM formula covers; the linear-attention hybrids among them it does not.
_DECODER_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_HYBRID_TYPES = ("qwen3_next", "qwen3_5")
# Sampling reads the logits in float32.
_LOGIT_BYTES = 4
# Live buffers of a ConvNet's widest stage: the input kept for the residual, the
# activation's output and the conv's output.
_CONV_BUFFERS = 3
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
    kv_cache_bytes: max_batch x max_len x kv_bytes_per_token.
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
) -> StageCost:
    """Estimate one stage replica serving `cfg` at `max_batch` items of `max_len` each.

    `dtype` overrides the component's own (weights, KV cache and activations alike).
    `prefill_tokens` (LMs) is the prompt positions one prefill forward batches (default
    PREFILL_TOKENS); a forward holds that or one max_len prompt, whichever is more, and no
    more than max_batch x max_len. `context_len` (DiT) is the
    text tokens per image; default: the config's max_text_len, else DIT_TEXT_TOKENS.
    """
    if max_batch < 1 or max_len < 1:
        raise ModelConfigError(f"max_batch and max_len must be >= 1, got {max_batch}, {max_len}")
    est = _estimator(cfg)
    try:
        nbytes = dtype_bytes(dtype or cfg.dtype)
    except ValueError as err:  # the dtype came from the model config or the stage: theirs
        raise ModelConfigError(str(err)) from None
    shape = _Shape(max_batch, max_len, nbytes, prefill_tokens, context_len)
    kv_per_token = est.kv_bytes_per_token(nbytes)
    return StageCost(
        params=est.count.params,
        active_params=est.count.active,
        params_source=est.source,
        weight_bytes=est.count.params * nbytes,
        kv_bytes_per_token=kv_per_token,
        kv_cache_bytes=max_batch * max_len * kv_per_token,
        activation_bytes=int(est.activation_bytes(shape)),
        flops_per_item=float(est.flops(shape)),
        item=est.item,
    )


# --- counting pieces ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Count:
    """Parameters, the share one item touches, and multiply-accumulates per application.

    Only matmul and conv weights carry MACs; biases, norms, layer scales, SnakeBeta and
    lookup tables are parameters without MACs.
    """

    params: int = 0
    active: int = 0
    macs: int = 0

    def __add__(self, other: _Count) -> _Count:
        return _Count(
            self.params + other.params, self.active + other.active, self.macs + other.macs
        )

    def __mul__(self, n: int) -> _Count:
        return _Count(self.params * n, self.active * n, self.macs * n)

    __rmul__ = __mul__


_NONE = _Count()


def _total(counts) -> _Count:
    return sum(counts, _NONE)


def _elementwise(n: int) -> _Count:
    """Per-channel weights: norms, layer scales, SnakeBeta alpha/beta, biases."""
    return _Count(n, n, 0)


def _table(n: int) -> _Count:
    """A lookup table (embeddings, codebooks): loaded, but no item multiplies it."""
    return _Count(n, 0, 0)


def _linear(n_in: int, n_out: int, bias: bool = False) -> _Count:
    w = n_in * n_out
    return _Count(w, w, w) + (_elementwise(n_out) if bias else _NONE)


def _conv(c_in: int, c_out: int, taps: int, groups: int = 1, bias: bool = True) -> _Count:
    """A conv or transposed conv with `taps` kernel positions (MACs per position it runs at)."""
    return _linear(c_in * taps // groups, c_out, bias)


def _gated_mlp(hidden: int, inter: int, bias: bool = False) -> _Count:
    """gate_proj, up_proj, down_proj (SwiGLU)."""
    return 2 * _linear(hidden, inter, bias) + _linear(inter, hidden, bias)


def _attention_dims(c: Mapping[str, Any]) -> tuple[int, int, int]:
    """(head_dim, q width, k/v width) of a transformer config."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
    return head_dim, c["num_attention_heads"] * head_dim, kv_heads * head_dim


def _attention(hidden: int, q_dim: int, kv_dim: int, qkv_bias: bool, o_bias: bool) -> _Count:
    """q, k, v and o projections."""
    qkv = _linear(hidden, q_dim, qkv_bias) + 2 * _linear(hidden, kv_dim, qkv_bias)
    return qkv + _linear(q_dim, hidden, o_bias)


def _token_workspace(width: int, q_dim: int, kv_dim: int, ffn: int) -> int:
    """Elements one token holds in a transformer layer, counted as if all were live at once.

    Residual + normed input (2 x width), q / k / v / attention output, and gate, up and
    their product in the MLP (3 x ffn). Attention is assumed fused (SDPA or flash): no
    L x L score matrix.
    """
    return 2 * width + 2 * q_dim + 2 * kv_dim + 3 * ffn


def _attention_flops(layers: int, q_dim: int, context: int) -> float:
    """QK^T and AV for one query over `context` keys, all layers: 2 matmuls x 2 FLOPs/MAC."""
    return 4.0 * layers * q_dim * context


# --- estimators ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
    batch: int
    length: int
    nbytes: int
    prefill_tokens: int | None
    context_len: int | None


class _Estimator(ABC):
    """A category's parameter count plus its activation and FLOP rules."""

    item = "token"

    def __init__(self, cfg: ComponentConfig, count: _Count, source: str):
        self.cfg = cfg
        self.c = cfg.config
        self.count = count
        self.source = source

    def kv_bytes_per_token(self, nbytes: int) -> int:
        return 0

    @abstractmethod
    def activation_bytes(self, s: _Shape) -> float:
        """Peak workspace bytes at the stage's batch."""

    @abstractmethod
    def flops(self, s: _Shape) -> float:
        """FLOPs per item (`item` says what an item is)."""


def _estimator(cfg: ComponentConfig) -> _Estimator:
    category = cfg.category
    if category in LM_CATEGORIES:
        return _LM(cfg)
    if category in ("vision_encoder", "audio_encoder"):
        return _Encoder(cfg)
    if category == "dit":
        if cfg.config.get("_class_name") == "WanTransformer3DModel":
            return _WanDiT(cfg)
        return _DiT(cfg)
    if category == "vae":
        return _VAE(cfg)
    if category == "vocoder":
        return _Vocoder(cfg)
    raise ModelConfigError(f"{_name(cfg)}: no cost rules for a {category}")


def _name(cfg: ComponentConfig) -> str:
    return f"{cfg.model}" + (f" [{cfg.component}]" if cfg.component else "")


def _counted(cfg: ComponentConfig, what: str) -> _Count:
    """The config's parameter count, for components no formula covers; every weight is
    taken as touched once per item position."""
    n = cfg.config.get("num_parameters")
    if not n:
        raise ModelConfigError(
            f"{_name(cfg)}: no parameter formula for {what} and no parameter count: the model "
            "directory has no safetensors checkpoint and the builtin catalog has no count "
            "(set config['num_parameters'])"
        )
    return _Count(n, n, n)


# --- decoder LMs (dense and MoE), text encoders, codec LMs ---------------------------------


def _attention_biases(c: Mapping[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, o bias). Qwen2-family attention biases q, k and v but never o;
    Llama/Qwen3-style `attention_bias` applies to all four projections."""
    if "qkv_bias" in c:
        return c["qkv_bias"], False
    if c.get("model_type", "").startswith("qwen2"):
        return True, False
    bias = c.get("attention_bias", False)
    return bias, bias


def _has_qk_norm(c: Mapping[str, Any]) -> bool:
    """Qwen3-family attention RMS-normalises q and k per head (one head_dim weight each)."""
    return c.get("use_qk_norm", c.get("model_type", "").startswith("qwen3"))


def _lm_attention(c: Mapping[str, Any]) -> _Count:
    head_dim, q_dim, kv_dim = _attention_dims(c)
    count = _attention(c["hidden_size"], q_dim, kv_dim, *_attention_biases(c))
    return count + (_elementwise(2 * head_dim) if _has_qk_norm(c) else _NONE)


def _is_sparse(c: Mapping[str, Any], layer: int) -> bool:
    """transformers' MoE layer rule (Qwen2-MoE, Qwen3-MoE, Qwen3-Omni)."""
    return (
        c.get("num_experts", 0) > 0
        and layer not in (c.get("mlp_only_layers") or [])
        and (layer + 1) % c.get("decoder_sparse_step", 1) == 0
    )


def _lm_mlp(c: Mapping[str, Any], layer: int) -> _Count:
    """One layer's MLP, or its MoE block: all experts loaded, top-k of them touched."""
    hidden = c["hidden_size"]
    if not _is_sparse(c, layer):
        return _gated_mlp(hidden, c["intermediate_size"], c.get("mlp_bias", False))
    expert = _gated_mlp(hidden, c["moe_intermediate_size"])
    routed = _Count(
        c["num_experts"] * expert.params,
        c["num_experts_per_tok"] * expert.active,
        c["num_experts_per_tok"] * expert.macs,
    )
    router = _linear(hidden, c["num_experts"])
    if c.get("shared_expert_intermediate_size"):
        # Qwen2-MoE-style shared expert and its sigmoid gate Linear(hidden, 1).
        shared = _gated_mlp(hidden, c["shared_expert_intermediate_size"]) + _linear(hidden, 1)
        return routed + router + shared
    return routed + router


def _decoder_stack(c: Mapping[str, Any]) -> _Count:
    """The layers and the final norm, without embeddings or head."""
    hidden = c["hidden_size"]
    norms = _elementwise(2 * hidden)  # input and post-attention RMSNorms
    layers = _total(
        _lm_attention(c) + _lm_mlp(c, layer) + norms for layer in range(c["num_hidden_layers"])
    )
    return layers + _elementwise(hidden)


def _code_predictor(c: Mapping[str, Any]) -> _Count:
    """A Qwen3 codec talker's code predictor, per codec frame.

    A small dense LM that predicts codebooks 1..G-1 of each frame from the talker's hidden
    state: G-1 code embeddings of the talker's width, G-1 heads, and a projection when the
    talker is wider than the predictor. Per frame it runs over G positions (the talker
    hidden plus G-1 codes) and applies each head once, so its MACs exceed its parameters.
    """
    cp = {"model_type": c.get("model_type", ""), **c["code_predictor_config"]}
    groups = c.get("num_code_groups") or cp["num_code_groups"]
    talker, width, vocab = c["hidden_size"], cp["hidden_size"], cp["vocab_size"]
    per_position = _decoder_stack(cp)
    if talker != width:
        per_position += _linear(talker, width, bias=True)
    heads = (groups - 1) * _linear(width, vocab)
    embeddings = _table((groups - 1) * vocab * talker)
    frame = _Count(per_position.params, per_position.active, groups * per_position.macs)
    return frame + heads + embeddings


class _LM(_Estimator):
    """Decoder LMs (dense or MoE), text encoders and codec LMs.

    Llama-layout model types (`_DECODER_TYPES`) are counted by formula; others use the
    config's `num_parameters` (a checkpoint count), every weight taken as touched per token.
    Formula params: embeddings (vocab x embedding_size) + layers [q/k/v/o with the family's
    biases, q/k norms for Qwen3, gated MLP or experts + router (+ shared expert), two
    RMSNorms] + final norm + lm_head unless tied + a code predictor if the config has one +
    the config's extra_parameters. FLOPs per token (per frame for a codec LM): 2 x MACs of
    the active weights (the lm_head included except for text encoders, which stop at hidden
    states; a codec LM's code predictor over its G positions) + attention over max_len keys.
    """

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        _, self.q_dim, self.kv_dim = _attention_dims(c)
        model_type = c.get("model_type", "")
        if not model_type.startswith(_DECODER_TYPES) or model_type.startswith(_HYBRID_TYPES):
            super().__init__(cfg, _counted(cfg, f"model_type '{model_type}'"), "count")
            return
        hidden, vocab = c["hidden_size"], c["vocab_size"]
        head = _linear(hidden, vocab)
        if cfg.category == "text_encoder":
            head = _table(head.params)
        if c.get("tie_word_embeddings"):
            head = _Count(0, head.active, head.macs)
        count = _table(vocab * c.get("embedding_size", hidden)) + _decoder_stack(c) + head
        if "code_predictor_config" in c:
            count += _code_predictor(c)
            self.item = "codec frame"
        extras = sum(c.get("extra_parameters", {}).values())
        super().__init__(cfg, count + _table(extras), "formula+counts" if extras else "formula")

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

    def activation_bytes(self, s: _Shape) -> float:
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

    def flops(self, s: _Shape) -> float:
        attention = _attention_flops(self.c["num_hidden_layers"], self.q_dim, s.length)
        return 2.0 * self.count.macs + attention


# --- vision and audio encoders ----------------------------------------------------------


class _Encoder(_Estimator):
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

    def activation_bytes(self, s: _Shape) -> float:
        per_token = _token_workspace(self.width, self.width, self.width, self.ffn)
        return s.batch * s.length * per_token * s.nbytes

    def flops(self, s: _Shape) -> float:
        return 2.0 * self.count.macs + _attention_flops(self.layers, self.width, s.length)


# --- diffusion transformers -------------------------------------------------------------


class _DiT(_Estimator):
    """The Qwen-Image MMDiT (diffusers QwenImageTransformer2DModel), exactly.

    Two streams share joint attention: image tokens go through img_in, to_q/k/v, to_out,
    img_mlp and proj_out; text tokens through txt_norm, txt_in, add_q/k/v, to_add_out and
    txt_mlp. The timestep embedding, img_mod / txt_mod and norm_out apply once per image.
    FLOPs per denoising step of one image: 2 x (image tokens x image-stream MACs + text
    tokens x text-stream MACs + per-image MACs) + joint attention over image + text tokens.
    Activations: max_batch x (image + text tokens) x (residual, normed, q/k/v/out and the
    4x MLP hidden before and after GELU = 14 x width) elements. A CFG pair counts as two in
    max_batch. Other DiT classes: the catalog's count, every weight applied to every token.
    """

    item = "denoising step of one image"

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        self.width = c["num_attention_heads"] * c["attention_head_dim"]
        self.layers = c.get("num_layers", 0)
        if c.get("_class_name") != "QwenImageTransformer2DModel":
            count = _counted(cfg, f"DiT class {c.get('_class_name')}")
            self.image_token = self.text_token = count
            self.per_image = _NONE
            super().__init__(cfg, count, "count")
            return
        width, layers = self.width, self.layers
        patch, joint = c["patch_size"], c["joint_attention_dim"]
        out = c.get("out_channels") or c["in_channels"]
        # Per stream per block: biased q/k/v/out projections, q/k RMSNorms, GELU MLP.
        stream = _attention(width, width, width, True, True)
        stream += _elementwise(2 * c["attention_head_dim"])
        stream += _linear(width, 4 * width, True) + _linear(4 * width, width, True)
        self.image_token = _linear(c["in_channels"], width, True) + layers * stream
        self.image_token += _linear(width, patch * patch * out, True)
        self.text_token = _elementwise(joint) + _linear(joint, width, True) + layers * stream
        timestep = _linear(256, width, True) + _linear(width, width, True)
        if c.get("use_additional_t_cond"):
            timestep += _table(2 * width)
        modulation = 2 * _linear(width, 6 * width, True)
        self.per_image = timestep + layers * modulation + _linear(width, 2 * width, True)
        super().__init__(cfg, self.image_token + self.text_token + self.per_image, "formula")

    def _text_tokens(self, s: _Shape) -> int:
        return s.context_len or self.c.get("max_text_len") or DIT_TEXT_TOKENS

    def activation_bytes(self, s: _Shape) -> float:
        tokens = s.length + self._text_tokens(s)
        return s.batch * tokens * 14 * self.width * s.nbytes

    def flops(self, s: _Shape) -> float:
        text = self._text_tokens(s)
        macs = s.length * self.image_token.macs + text * self.text_token.macs
        tokens = s.length + text
        attention = _attention_flops(self.layers, self.width, tokens) * tokens
        return 2.0 * (macs + self.per_image.macs) + attention


class _WanDiT(_Estimator):
    """The Wan video DiT (diffusers WanTransformer3DModel), exactly.

    Per block: self-attention over the video's tokens (biased q/k/v/o, q and k RMS-normed
    across heads), cross-attention to the text (q and o per video token, k and v per text
    token, k RMS-normed), a GELU MLP, the affine cross-attention norm and the block's
    modulation table. Per video token: the patch embedding (a Conv3d over the patch) and
    the output projection; per text token: the text embedder's two linears and each block's
    cross-attention k/v; per video: the timestep embedding and its 6-way projection — per
    token where the pipeline gives a timestep per token (`expand_timesteps`, Wan2.2-TI2V).
    FLOPs per denoising step of one video (or image): 2 x those MACs + self-attention over
    the video's tokens + cross-attention over the text's. Activations: max_batch x (video +
    text tokens) x 14 x width elements, as for the MMDiT. A CFG pair counts as two.
    """

    item = "denoising step of one video"

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        width = c["num_attention_heads"] * c["attention_head_dim"]
        self.width, self.layers = width, c["num_layers"]
        patch = c["patch_size"]
        taps = patch[0] * patch[1] * patch[2]
        ffn, text_dim, freq = c["ffn_dim"], c["text_dim"], c["freq_dim"]
        self_attn = _attention(width, width, width, True, True) + _elementwise(2 * width)
        cross_q = _linear(width, width, True) + _linear(width, width, True)  # q, o
        cross_kv = 2 * _linear(width, width, True)  # per text token
        block = self_attn + cross_q + _elementwise(2 * width)  # cross-attention q/k norms
        block += _linear(width, ffn, True) + _linear(ffn, width, True)
        block += _elementwise(2 * width) if c.get("cross_attn_norm") else _NONE
        self.video_token = _conv(c["in_channels"], width, taps) + self.layers * block
        self.video_token += _linear(width, c["out_channels"] * taps, True)
        text_embedder = _linear(text_dim, width, True) + _linear(width, width, True)
        self.text_token = text_embedder + self.layers * cross_kv
        time = _linear(freq, width, True) + _linear(width, width, True)
        time += _linear(width, 6 * width, True)
        self.per_token_time = bool(c.get("expand_timesteps"))
        self.time = time
        tables = _elementwise(self.layers * 6 * width + 2 * width)
        count = self.video_token + self.text_token + time + tables
        super().__init__(cfg, count, "formula")

    def _text_tokens(self, s: _Shape) -> int:
        return s.context_len or self.c.get("max_text_len") or DIT_TEXT_TOKENS

    def activation_bytes(self, s: _Shape) -> float:
        return s.batch * (s.length + self._text_tokens(s)) * 14 * self.width * s.nbytes

    def flops(self, s: _Shape) -> float:
        text = self._text_tokens(s)
        macs = s.length * self.video_token.macs + text * self.text_token.macs
        macs += self.time.macs * (s.length if self.per_token_time else 1)
        attention = _attention_flops(self.layers, self.width, s.length) * s.length
        cross = _attention_flops(self.layers, self.width, text) * s.length
        return 2.0 * macs + attention + cross


# --- VAEs -------------------------------------------------------------------------------


def _resnet(c_in: int, c_out: int) -> _Count:
    """diffusers ResnetBlock2D without time embedding: 2 GroupNorms, 2 3x3 convs, 1x1 shortcut."""
    shortcut = _conv(c_in, c_out, 1) if c_in != c_out else _NONE
    norms = _elementwise(2 * c_in + 2 * c_out)
    return norms + _conv(c_in, c_out, 9) + _conv(c_out, c_out, 9) + shortcut


def _mid_block(channels: int, attention: bool) -> _Count:
    """UNetMidBlock2D: two resnets around one single-head attention (GroupNorm, q, k, v, out)."""
    resnets = 2 * _resnet(channels, channels)
    if not attention:
        return resnets
    return resnets + _elementwise(2 * channels) + 4 * _linear(channels, channels, True)


def _autoencoder_kl(c: Mapping[str, Any]) -> tuple[_Count, list[tuple[_Count, int]]]:
    """diffusers AutoencoderKL: (encoder + quant conv, decoder pieces as (count, area)).

    The area is the number of output positions per latent position at which the piece
    runs during decode (1 at latent resolution, 4 after one 2x upsampling, ...).
    """
    chans, per_block = list(c["block_out_channels"]), c["layers_per_block"]
    z, attention = c["latent_channels"], c.get("mid_block_add_attention", True)
    encoder = _conv(c["in_channels"], chans[0], 9)
    prev = chans[0]
    for i, out in enumerate(chans):
        encoder += _total(_resnet(prev if j == 0 else out, out) for j in range(per_block))
        if i < len(chans) - 1:
            encoder += _conv(out, out, 9)  # Downsample2D
        prev = out
    encoder += _mid_block(chans[-1], attention)
    encoder += _elementwise(2 * chans[-1]) + _conv(chans[-1], 2 * z, 9)
    if c.get("use_quant_conv", True):
        encoder += _conv(2 * z, 2 * z, 1)
    pieces = [(_conv(z, chans[-1], 9) + _mid_block(chans[-1], attention), 1)]
    if c.get("use_post_quant_conv", True):
        pieces.append((_conv(z, z, 1), 1))
    prev = chans[-1]
    for i, out in enumerate(reversed(chans)):
        resnets = _total(_resnet(prev if j == 0 else out, out) for j in range(per_block + 1))
        pieces.append((resnets, 4**i))
        if i < len(chans) - 1:
            pieces.append((_conv(out, out, 9), 4 ** (i + 1)))  # Upsample2D: 2x nearest, conv
        prev = out
    full_res = _elementwise(2 * chans[0]) + _conv(chans[0], c["out_channels"], 9)
    pieces.append((full_res, 4 ** (len(chans) - 1)))
    return encoder, pieces


def _block_types_supported(c: Mapping[str, Any]) -> bool:
    down = set(c.get("down_block_types", ())) <= {"DownEncoderBlock2D"}
    return down and set(c.get("up_block_types", ())) <= {"UpDecoderBlock2D"}


class _VAE(_Estimator):
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
        self.pieces: list[tuple[_Count, int]] | None = None
        if c.get("_class_name") == "AutoencoderKL" and _block_types_supported(c):
            encoder, self.pieces = _autoencoder_kl(c)
            super().__init__(cfg, encoder + _total(p for p, _ in self.pieces), "formula")
        else:
            super().__init__(cfg, _counted(cfg, f"VAE class {c.get('_class_name')}"), "count")
        self.scale = cfg.vae_scale_factor or 1
        if "block_out_channels" in c:
            self.full_res_channels = c["block_out_channels"][0]
        else:
            self.full_res_channels = c["base_dim"] * c["dim_mult"][0]

    def activation_bytes(self, s: _Shape) -> float:
        pixels = s.length * self.scale**2
        return s.batch * pixels * self.full_res_channels * _VAE_FULL_RES_BUFFERS * s.nbytes

    def flops(self, s: _Shape) -> float:
        if self.pieces is None:
            return (self.c.get("flops_per_position") or 2.0 * self.count.macs) * s.length
        macs = sum(p.macs * area for p, area in self.pieces) * s.length
        attention = 0.0
        if self.c.get("mid_block_add_attention", True):
            attention = _attention_flops(1, self.c["block_out_channels"][-1], s.length) * s.length
        return 2.0 * macs + attention


# --- vocoders ---------------------------------------------------------------------------


def _snake_decoder(c: Mapping[str, Any], width: int) -> tuple[list[tuple[_Count, int]], int]:
    """Upsampling tail shared by Qwen3-Omni's code2wav and Qwen3-TTS's tokenizer decoder.

    Returns pieces as (count, positions per codec frame at which its MACs run) and the
    peak elements per frame of any stage. Transposed convs run at their input positions,
    convs at their output positions.
    """
    pieces: list[tuple[_Count, int]] = []
    positions, peak = 1, 0
    for ratio in c.get("upsampling_ratios", ()):
        pieces.append((_conv(width, width, ratio), positions))
        positions *= ratio
        convnext = _conv(width, width, 7, groups=width) + _elementwise(2 * width)  # + LayerNorm
        convnext += _linear(width, 4 * width, True) + _linear(4 * width, width, True)
        pieces.append((convnext + _elementwise(width), positions))  # + gamma
        peak = max(peak, 4 * width * positions)
    dim = c["decoder_dim"]
    pieces.append((_conv(width, dim, 7), positions))
    peak = max(peak, dim * positions)
    for i, rate in enumerate(c["upsample_rates"]):
        c_in, c_out = dim // 2**i, dim // 2 ** (i + 1)
        pieces.append((_elementwise(2 * c_in) + _conv(c_in, c_out, 2 * rate), positions))
        positions *= rate
        # Three residual units (dilations 1, 3, 9): SnakeBeta, conv k7, SnakeBeta, conv k1.
        unit = _elementwise(4 * c_out) + _conv(c_out, c_out, 7) + _conv(c_out, c_out, 1)
        pieces.append((3 * unit, positions))
        peak = max(peak, c_out * positions)
    last = dim // 2 ** len(c["upsample_rates"])
    pieces.append((_elementwise(2 * last) + _conv(last, 1, 7), positions))
    return pieces, peak


def _code2wav(c: Mapping[str, Any]) -> tuple[list[tuple[_Count, int]], int]:
    """Qwen3-Omni Code2Wav and Qwen3-TTS's 12 Hz tokenizer decoder: (pieces, peak elements).

    Codes enter through summed embeddings (Qwen3-Omni) or a split residual VQ with 1x1
    projections and a causal conv (Qwen3-TTS, whose transformer is narrower and projects
    in and out); then a sliding-window transformer with layer scales and the ConvNet tail.
    """
    hidden = c["hidden_size"]
    bias = c.get("attention_bias", False)
    _, q_dim, kv_dim = _attention_dims(c)
    attention = _attention(hidden, q_dim, kv_dim, bias, bias)  # no q/k norms
    # Two RMSNorms and two layer scales per layer.
    layer = attention + _gated_mlp(hidden, c["intermediate_size"]) + _elementwise(4 * hidden)
    transformer = c["num_hidden_layers"] * layer + _elementwise(hidden)
    codebooks = c["num_quantizers"] * c["codebook_size"]
    if "codebook_dim" in c:
        dim, width = c["codebook_dim"], c["latent_dim"]
        # Semantic and acoustic RVQs: half-width codebooks (an embedding_sum plus a
        # cluster_usage entry per code) between 1x1 projections; decoding runs only the
        # output projections, the input ones serve encoding.
        front = _table(codebooks * (dim // 2 + 1) + 2 * dim * (dim // 2))
        front += 2 * _conv(dim // 2, dim, 1, bias=False) + _conv(dim, width, 3)
        transformer += _linear(width, hidden, True) + _linear(hidden, width, True)
    else:
        width = hidden
        front = _table(codebooks * hidden)
    tail, peak = _snake_decoder(c, width)
    return [(front + transformer, 1), *tail], peak


class _Vocoder(_Estimator):
    """Codec frames to waveform.

    Qwen3 code2wav family: exact parameters; FLOPs per frame = 2 x each piece's MACs x its
    positions per frame + sliding-window attention; activations = the widest stage's peak
    elements per frame x `_CONV_BUFFERS`. Others (Qwen2.5-Omni token2wav): the catalog's
    count and measured `flops_per_frame`, else the lower bound 2 x params; activations from
    `_VOCODER_ELEMENTS_PER_SAMPLE`. A forward decodes at most VOCODER_FORWARD_FRAMES frames
    per request.
    """

    item = "codec frame"

    def __init__(self, cfg: ComponentConfig):
        c = cfg.config
        self.pieces: list[tuple[_Count, int]] | None = None
        if "upsampling_ratios" in c and "decoder_dim" in c:
            self.pieces, peak = _code2wav(c)
            self.elements_per_frame = peak * _CONV_BUFFERS
            super().__init__(cfg, _total(p for p, _ in self.pieces), "formula")
        else:
            super().__init__(cfg, _counted(cfg, "this vocoder"), "count")
            self.elements_per_frame = _VOCODER_ELEMENTS_PER_SAMPLE * (cfg.samples_per_frame or 1)

    def activation_bytes(self, s: _Shape) -> float:
        frames = min(s.length, VOCODER_FORWARD_FRAMES)
        return s.batch * frames * self.elements_per_frame * s.nbytes

    def flops(self, s: _Shape) -> float:
        if self.pieces is None:
            return self.c.get("flops_per_frame") or 2.0 * self.count.macs
        c = self.c
        window = min(c.get("sliding_window") or s.length, s.length)
        _, q_dim, _ = _attention_dims(c)
        macs = sum(p.macs * positions for p, positions in self.pieces)
        return 2.0 * macs + _attention_flops(c["num_hidden_layers"], q_dim, window)

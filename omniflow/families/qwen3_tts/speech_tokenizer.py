"""The 12 Hz speech tokenizer (`speech_tokenizer/` of a checkpoint, `Qwen3TTSTokenizerV2Model`).

Decoder (`decoder.*` in `speech_tokenizer/model.safetensors`), 16 codebooks of a 12.5 Hz frame
to 1920 samples of 24 kHz audio, every layer causal:

- `quantizer`: a split residual VQ. Codebook 0 (semantic) and codebooks 1..15 (acoustic)
  each sum their codewords (`embedding_sum / cluster_usage`, 256 wide), and each group goes
  through its 1x1 output projection to 512; the two are added.
- `pre_conv`: causal conv (kernel 3) to the latent width (1024).
- `pre_transformer`: input projection to 512, 8 pre-norm layers (RMSNorm, rotary attention
  over a sliding window of 72 frames, SwiGLU MLP, each residual scaled by a learnt
  LayerScale), a final RMSNorm and the output projection back to 1024.
- `upsample`: for each ratio (2, 2) a causal transposed conv and a ConvNeXt block (causal
  depthwise conv 7, LayerNorm, MLP x4, GELU, layer scale).
- `decoder`: causal conv 7 to 1536, four blocks (SnakeBeta, causal transposed conv x8, x5,
  x4, x3 halving the width, three residual units of dilated causal convs 7 at dilations
  1, 3, 9), SnakeBeta, causal conv 7 to one channel; the waveform is clamped to [-1, 1].

Being causal, the decoder looks at no frame ahead; behind, it looks as far as its layers
reach (`field`): 2 frames through `pre_conv`, 71 per attention layer, and the
convolutions' few more, 580 frames for the published 8 layers of window 72. A window that
starts at least that far before the frames it keeps decodes them as the whole utterance
does (the rotary attention depends on position differences only).

Streamed (`SpeechDecoder.stream`), it decodes only new frames and carries what the next ones
need, each stream's in its slot (`omniflow.backends.carried_state`: `Carried`, `StateSlots`):
each causal conv its last `(kernel - 1) * dilation` inputs, each transposed conv the inputs
its overlap spans (one for kernel 2 x stride, none for kernel = stride), each attention
layer its rotated keys and values of the last `window - 1` frames; the frames decoded so far
(the next frame's position, so positions are the whole utterance's) the caller passes. Its
transposed convs cut on the right only, so nothing is delayed: a window of n frames emits
its n frames, the whole decode's up to float rounding, and costs n frames of work.

Encoder (`encoder.*`): transformers' `MimiModel` without its decoder parts, from
`encoder_config`; `encode` keeps the first `encoder_valid_num_quantizers` (16) codebooks.
It turns a voice-clone request's reference audio into the reference codes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omniflow.backends import receptive_field
from omniflow.backends.carried_state import Carried, StateSlots, sliding_window
from omniflow.backends.receptive_field import Field
from omniflow.families.qwen3_tts.config import DECODER_DEFAULTS, SPEECH_TOKENIZER, Qwen3TTSError
from omniflow.families.qwen3_tts.modeling import load_weights, local_file, read_tensors
from omniflow.kernels.snake_beta import snake_beta


def read_config(root: str) -> dict:
    import json

    path = local_file(root, f"{SPEECH_TOKENIZER}/config.json")
    if path is None:
        raise Qwen3TTSError(f"{root} has no {SPEECH_TOKENIZER}/config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("model_type") != "qwen3_tts_tokenizer_12hz":
        raise Qwen3TTSError(
            f"{root}: the speech tokenizer is a {config.get('model_type')!r}, not the 12 Hz one "
            "(qwen3_tts_tokenizer_12hz) this decoder implements"
        )
    return config


# --- layers ------------------------------------------------------------------------------


class CausalConv(nn.Module):
    """A convolution padded on the left by what its kernel spans (less its stride)."""

    def __init__(
        self, cin: int, cout: int, kernel: int, dilation: int = 1, stride: int = 1, groups: int = 1
    ):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, dilation=dilation, groups=groups)
        self.span = (kernel - 1) * dilation + 1
        self.stride = stride
        self.padding = self.span - stride

    def forward(self, x: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        if carried is not None:
            return carried.causal_conv(self.conv, x, self.padding)
        length = x.shape[-1]
        frames = math.ceil((length - self.span + self.padding) / self.stride + 1)
        extra = (frames - 1) * self.stride + (self.span - self.padding) - length
        return self.conv(F.pad(x, (self.padding, extra))).contiguous()

    def field(self, field: Field) -> Field:
        conv = self.conv
        return receptive_field.conv(
            field, conv.kernel_size[0], conv.stride[0], self.padding, conv.dilation[0]
        )


class CausalConvTranspose(nn.Module):
    """A transposed convolution whose overhang (kernel - stride) is cut on the right."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride)
        self.trim = kernel - stride

    def forward(self, x: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        if carried is not None:
            return carried.transposed_conv(self.conv, x)
        x = self.conv(x)
        return (x[..., : x.shape[-1] - self.trim] if self.trim > 0 else x).contiguous()

    def field(self, field: Field) -> Field:
        return receptive_field.conv_transpose1d(field, self.conv)  # cut on the right: no shift


class SnakeBeta(nn.Module):
    """x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return snake_beta(x, self.alpha, self.beta)  # one kernel on CUDA


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        h = self.dwconv(x, carried).permute(0, 2, 1)
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 2, 1)

    def field(self, field: Field) -> Field:
        return receptive_field.union(field, self.dwconv.field(field))


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x), carried)))

    def field(self, field: Field) -> Field:
        return receptive_field.union(field, self.conv2.field(self.conv1.field(field)))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalConvTranspose(cin, cout, 2 * rate, rate)]
            + [ResidualUnit(cout, d) for d in (1, 3, 9)]
        )

    def forward(self, x: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        x = self.block[0](x)  # SnakeBeta: per sample
        for layer in self.block[1:]:
            x = layer(x, carried)
        return x

    def field(self, field: Field) -> Field:
        for layer in self.block[1:]:
            field = layer.field(field)
        return field


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, scale: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.heads, self.kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim", c["hidden_size"] // self.heads)
        bias = c["attention_bias"]
        self.q_proj = nn.Linear(c["hidden_size"], self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c["hidden_size"], self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c["hidden_size"], self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c["hidden_size"], bias=bias)

    def forward(self, x, cos, sin, mask, carried: Carried | None = None, past: int = 0):
        """`past`: with `carried`, the frames before the window whose (rotated) keys and
        values it carries."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if carried is not None:
            k, v = carried.extend(k, past, dim=2), carried.extend(v, past, dim=2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: dict):
        from transformers.activations import ACT2FN

        super().__init__()
        self.gate_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(c["hidden_size"], c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], c["hidden_size"], bias=False)
        self.act_fn = ACT2FN[c["hidden_act"]]

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn_layer_scale = LayerScale(c["hidden_size"], c["layer_scale_initial_scale"])
        self.mlp_layer_scale = LayerScale(c["hidden_size"], c["layer_scale_initial_scale"])

    def forward(self, x, cos, sin, mask, carried: Carried | None = None, past: int = 0):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, mask, carried, past)
        x = x + self.self_attn_layer_scale(attn)
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class Transformer(nn.Module):
    """The decoder's `pre_transformer`: sliding-window causal attention over frames."""

    def __init__(self, c: dict):
        super().__init__()
        self.layers = nn.ModuleList([TransformerLayer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.input_proj = nn.Linear(c["latent_dim"], c["hidden_size"])
        self.output_proj = nn.Linear(c["hidden_size"], c["latent_dim"])
        self.window = int(c["sliding_window"])
        head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
        theta = float(c["rope_theta"])
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        """Frames `x` `[B, T, latent]`: the whole utterance, or (`carried`) the frames after
        those each row decoded before, attending to the `window - 1` frames it carries."""
        q, mask, past = sliding_window(carried, x.shape[1], self.window, x.device)
        freqs = q[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B or 1, 1, T, head_dim]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        h = self.input_proj(x)
        for layer in self.layers:
            h = layer(h, cos, sin, mask, carried, past)
        return self.output_proj(self.norm(h))

    def field(self, field: Field) -> Field:
        for _ in self.layers:
            field = receptive_field.causal_attention(field, self.window)
        return field


class Codebook(nn.Module):
    """`EuclideanCodebook`: codewords are `embedding_sum / cluster_usage`."""

    def __init__(self, dim: int, size: int):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def codewords(self) -> torch.Tensor:
        return self.embedding_sum / self.cluster_usage.clamp(min=1e-5)[:, None]


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int):
        super().__init__()
        self._codebook = Codebook(dim, size)


class _VQLayers(nn.Module):
    def __init__(self, n: int, dim: int, size: int):
        super().__init__()
        self.layers = nn.ModuleList([_VQ(dim, size) for _ in range(n)])


class ResidualVQ(nn.Module):
    """A group of codebooks: summed codewords through the group's output projection."""

    def __init__(self, n: int, dim: int, outer: int, size: int):
        super().__init__()
        self.input_proj = nn.Conv1d(outer, dim, 1, bias=False)  # the encoder side's
        self.output_proj = nn.Conv1d(dim, outer, 1, bias=False)
        self.vq = _VQLayers(n, dim, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes `[B, n, T]` -> `[B, outer, T]`."""
        total = 0
        for i, layer in enumerate(self.vq.layers):
            total = total + F.embedding(codes[:, i], layer._codebook.codewords())
        return self.output_proj(total.transpose(1, 2))


class SplitRVQ(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        dim, outer, size, n = (
            c["codebook_dim"] // 2,
            c["codebook_dim"],
            c["codebook_size"],
            c["num_quantizers"],
        )
        self.semantic = int(c.get("num_semantic_quantizers", 1))
        self.rvq_first = ResidualVQ(self.semantic, dim, outer, size)
        self.rvq_rest = ResidualVQ(n - self.semantic, dim, outer, size)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        out = self.rvq_first.decode(codes[:, : self.semantic])
        if codes.shape[1] > self.semantic:
            out = out + self.rvq_rest.decode(codes[:, self.semantic :])
        return out


class SpeechDecoder(nn.Module):
    """`Qwen3TTSTokenizerV2Decoder`: codes `[B, 16, T]` -> audio `[B, 1, T * 1920]`."""

    def __init__(self, config: dict):
        super().__init__()
        c = {**DECODER_DEFAULTS, **config}
        self.num_quantizers = c["num_quantizers"]
        self.codebook_size = c["codebook_size"]
        self.quantizer = SplitRVQ(c)
        self.pre_conv = CausalConv(c["codebook_dim"], c["latent_dim"], 3)
        self.pre_transformer = Transformer(c)
        self.upsample = nn.ModuleList(
            nn.ModuleList(
                [
                    CausalConvTranspose(c["latent_dim"], c["latent_dim"], r, r),
                    ConvNeXtBlock(c["latent_dim"]),
                ]
            )
            for r in c["upsampling_ratios"]
        )
        rates, width = c["upsample_rates"], c["decoder_dim"]
        layers = [CausalConv(c["latent_dim"], width, 7)]
        layers += [
            DecoderBlock(width // 2**i, width // 2 ** (i + 1), r) for i, r in enumerate(rates)
        ]
        out = width // 2 ** len(rates)
        layers += [SnakeBeta(out), CausalConv(out, 1, 7)]
        self.decoder = nn.ModuleList(layers)
        self.samples_per_frame = math.prod(list(rates) + list(c["upsampling_ratios"]))

    def forward(self, codes: torch.Tensor, carried: Carried | None = None) -> torch.Tensor:
        """The waveform of `codes`: the whole utterance's, or (`carried`) that of the frames
        after those each row decoded before."""
        if codes.shape[1] != self.num_quantizers:
            raise Qwen3TTSError(f"expected {self.num_quantizers} codebooks, got {codes.shape[1]}")
        h = self.pre_conv(self.quantizer.decode(codes), carried).transpose(1, 2)
        h = self.pre_transformer(h, carried).permute(0, 2, 1)
        for blocks in self.upsample:
            for block in blocks:
                h = block(h, carried)
        for layer in self.decoder:
            h = layer(h) if isinstance(layer, SnakeBeta) else layer(h, carried)
        return h.clamp(min=-1, max=1)

    def stream(
        self,
        codes: torch.Tensor,
        states: StateSlots,
        slots: torch.Tensor,
        frames: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """The waveforms `[B, 1, T * samples_per_frame]` of each row's next frames, codes
        `[B, 16, T]` padded on the right past the row's `lengths[b]`, after the `frames[b]`
        its stream decoded before (0: a new stream), whose state is in slot `slots[b]` of
        `states`; each slot then holds its row's state after its own last frame. Device
        work only, at the inputs' shapes: no host syncs (what a CUDA graph captures)."""
        return self(codes, Carried(states, slots, frames, lengths))

    def field(self) -> Field:
        """Where frame 0 reaches, walked through the layers in forward order."""
        field = self.pre_conv.field(Field(0, 0))
        field = self.pre_transformer.field(field)
        for transposed, convnext in self.upsample:
            field = convnext.field(transposed.field(field))
        for layer in self.decoder:
            if not isinstance(layer, SnakeBeta):
                field = layer.field(field)
        return field


class SpeechTokenizerDecoder(nn.Module):
    """The speech tokenizer's decoder under its checkpoint prefix (`decoder.`)."""

    def __init__(self, config: dict):
        super().__init__()
        self.decoder = SpeechDecoder(config.get("decoder_config") or {})


def load_decoder(root: str, device: str) -> SpeechDecoder:
    """The speech tokenizer's decoder of the checkpoint at `root`, float32, eval mode."""
    config = read_config(root)
    module = SpeechTokenizerDecoder(config)
    tensors = read_tensors(root, "decoder.", SPEECH_TOKENIZER)
    load_weights(
        module.decoder,
        {k: v.float() for k, v in tensors.items()},
        f"{root} speech tokenizer decoder",
    )
    rate = config.get("decode_upsample_rate")
    if rate is not None and int(rate) != module.decoder.samples_per_frame:
        raise Qwen3TTSError(
            f"{root}: decode_upsample_rate {rate}, but the decoder's rates make "
            f"{module.decoder.samples_per_frame} samples per frame"
        )
    return module.decoder.to(device).eval()


# --- the encoder (reference audio -> codes) ------------------------------------------------


def mimi_config(config: dict):
    """transformers' MimiConfig of the tokenizer's encoder, without its decoder half. Its
    attention is full causal attention: transformers 4.57.3, which the reference pins and
    its weights were made with, did not apply Mimi's `sliding_window` in this path
    (qwen-tts-hf restores the same behaviour on transformers 5), so the window is set to the
    whole position range."""
    from transformers import MimiConfig

    mimi = MimiConfig(**(config.get("encoder_config") or {}), decoder_config=None)
    mimi.sliding_window = mimi.max_position_embeddings
    return mimi


# The published encoder's names are transformers 4.57's flat MimiModel's (the reference's
# `Qwen3TTSTokenizerV2Encoder`); transformers 5 nests the encoder half. Published -> here:
_MIMI_NAMES = (
    ("encoder.layers.", "encoder.encoder_seanet.layers."),
    ("encoder_transformer.", "encoder.encoder_transformer."),
    ("downsample.", "encoder.downsample."),
)


def mimi_name(published: str) -> str:
    for old, new in _MIMI_NAMES:
        if published.startswith(old):
            return new + published[len(old) :]
    return published


def published_mimi_name(name: str) -> str:
    for old, new in _MIMI_NAMES:
        if name.startswith(new):
            return old + name[len(new) :]
    return name


class SpeechEncoder(nn.Module):
    """Reference audio -> codes: the tokenizer's Mimi encoder and quantizer."""

    def __init__(self, config: dict):
        from transformers import MimiModel

        super().__init__()
        self.encoder = MimiModel(mimi_config(config))
        self.valid = int(config.get("encoder_valid_num_quantizers", 16))
        self.hop = int(config.get("encode_downsample_rate", 1920))
        self.rate = int(config.get("input_sample_rate", 24000))

    def published_state(self) -> dict[str, torch.Tensor]:
        """The encoder's tensors (buffers too: the codebooks) under the published names."""
        return {published_mimi_name(k): v for k, v in self.encoder.state_dict().items()}

    @torch.inference_mode()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """Codes `[frames, valid]` of mono audio `[samples]` at the input rate."""
        weight = next(self.parameters())
        values = audio.to(weight.device, weight.dtype)[None, None]
        codes = self.encoder.encode(values).audio_codes
        frames = -(-audio.shape[-1] // self.hop)
        return codes[0, : self.valid, :frames].transpose(0, 1).long()


def load_encoder(root: str, device: str) -> SpeechEncoder:
    config = read_config(root)
    module = SpeechEncoder(config)
    tensors = {
        mimi_name(k): v.float() for k, v in read_tensors(root, "encoder.", SPEECH_TOKENIZER).items()
    }
    load_weights(module.encoder, tensors, f"{root} speech tokenizer encoder")
    return module.to(device).eval()

"""What each tiny checkpoint is: its real architecture's classes, configured tiny.

A recipe writes one checkpoint directory with the same `save_pretrained` calls a real
checkpoint's authors use, so loading it goes through exactly the code path that loads the
real model. Weights are random but seeded in a way that gives the same bytes on every
machine (`seed_weights`). `omniflow.checkpoints.tiny` runs recipes into its cache atomically;
this module only knows what goes into the directory.

Layout facts that users of a checkpoint need (special-token ids, codec-token offsets,
speaker tokens) are written into the checkpoint's own config files, never only kept here.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omniflow.checkpoints.tiny_tokenizer import EDIT_CORPUS, build_tokenizer

# Bump when any recipe's output changes, so cached checkpoints are rebuilt.
RECIPE_VERSION = 1

OMNI_SPEAKERS = ("Chelsie", "Ethan")
TTS_SPEAKERS = ("Vivian", "Ryan")
# The tts checkpoint's top-level index, naming its parts (diffusers' model_index.json form).
TTS_INDEX = "model_index.json"
# How the tts talker sees the text it speaks; `{text}` is replaced by the request's text.
TTS_TEXT_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n"

# Shared tiny text-decoder dims (a Qwen2.5-7B decoder scaled down: 64 wide, 2 layers,
# grouped-query attention with 4 query and 2 key/value heads of 16 dims).
_TEXT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
# Qwen2.5-VL / Omni multimodal RoPE: the 8 rotary frequency pairs of a 16-dim head split
# over (time, height, width) in the proportions of the real [16, 24, 24].
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
# Qwen2.5-VL / Omni vision tower: 2 blocks (the last one full attention, as every 8th is
# in the real 32), real patching (14 px patches, 2 frames, 2x2 merge).
_VISION_DIMS = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "fullatt_block_indexes": [1],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
}
# Both tiny codecs: 128 codes, one codebook, 24 kHz audio.
_CODEBOOK_SIZE = 128
_SAMPLE_RATE = 24000


@dataclass(frozen=True)
class Recipe:
    """How to build one tiny checkpoint.

    `build(out)` writes the checkpoint into the empty directory `out`; it yields the label
    of each part just before building it (for progress bars), in the order of `parts`.
    """

    name: str
    description: str
    parts: tuple[str, ...]
    build: Callable[[Path], Iterator[str]]


# --- seeded weights ------------------------------------------------------------------------


def portable_uniform(key: str, shape: tuple[int, ...], bound: float, center: float = 0.0):
    """float32 values uniform in [center - bound, center + bound), the same on every machine.

    Seeded by `key`. numpy's PCG64 is integer arithmetic and the affine map is exactly
    rounded IEEE arithmetic, so unlike torch's CPU `normal_` (which takes an AVX2 path on
    some machines and a scalar one on others) the bits do not depend on the machine.
    """
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    unit = np.random.Generator(np.random.PCG64(seed)).random(math.prod(shape))
    values = ((2.0 * unit - 1.0) * bound + center).astype(np.float32)
    return torch.from_numpy(values).reshape(shape)


def _fan_in(weight: torch.Tensor) -> int:
    return weight.numel() // weight.shape[0]


def seed_weights(model: torch.nn.Module, key: str) -> torch.nn.Module:
    """Redraw every randomly initialised parameter portably; return the model in eval mode.

    Constant parameters (norm weights, zero biases, Snake alphas) keep the architecture's
    own init: constants are exact on every machine. Random matrices and kernels get std
    1/sqrt(fan_in), which keeps activations near unit scale (at these widths the
    architectures' own std-0.02 inits shrink the signal layer by layer, until token2wav's
    waveform is ~1e-7 and an LM's logits are so flat that greedy decoding hangs on float
    noise). Random biases (PyTorch's default init, in diffusers models) get PyTorch's
    rule, uniform within 1/sqrt(fan_in) of their layer's weight. Scales come from shapes,
    never from measuring the machine-dependent init. Tied parameters are drawn once, so
    they stay tied.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if bool(param.min() == param.max()):
                continue
            if param.ndim >= 2:
                bound = math.sqrt(3.0 / _fan_in(param))
            elif name.endswith(".bias") and f"{name[: -len('bias')]}weight" in params:
                bound = 1.0 / math.sqrt(_fan_in(params[f"{name[: -len('bias')]}weight"]))
            else:
                raise ValueError(f"{key}: no portable init rule for random parameter '{name}'")
            param.copy_(portable_uniform(f"{key}/{name}", tuple(param.shape), bound))
    return model.eval()


def _silence_rows(weight: torch.Tensor, start: int) -> None:
    """Zero an output head's rows from `start` on: ids the real model never predicts.

    Real Qwen vocabularies extend past the ids the model is trained to emit (a thinker's
    past its tokenizer, the talker's past its codec specials). Zero rows give those ids a
    logit of exactly 0, which the best of a random head's real ids beats, so greedy
    decoding emits only ids that the tokenizer or the next stage can take.
    """
    with torch.no_grad():
        weight[start:] = 0


def _scale_output(layer: torch.nn.Module, gain: float) -> None:
    """Scale a vocoder's last layer so its waveform has a speech-like std of about 0.3.

    With unit-scale activations the last layer's output is tens of units wide and the
    vocoder's final clamp or tanh saturates it to +-1, where any two waveforms agree up to
    sign; `gain` is 0.3 over the std measured at the layer for this recipe's weights.
    """
    with torch.no_grad():
        for param in layer.parameters():
            param.mul_(gain)


def _special_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# --- qwen2 ---------------------------------------------------------------------------------


def _chat_lm(model, tokenizer):
    """A Qwen chat LM's head and generation defaults: it emits only the tokenizer's ids, ends
    at <|im_end|> or <|endoftext|>, and decodes greedily."""
    from transformers import GenerationConfig

    ids = _special_ids(tokenizer)
    _silence_rows(model.lm_head.weight, len(tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    return model


def _build_qwen2(out: Path, heads: tuple[int, int] = (4, 2)) -> Iterator[str]:
    """`heads`: attention and key/value heads over the same 64-wide projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    ids = _special_ids(tokenizer)
    tokenizer.save_pretrained(out)

    yield "model"
    config = Qwen2Config(
        vocab_size=_round_up(len(tokenizer), 64),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        # Qwen2.5-0.5B/1.5B tie the output head to the input embedding.
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **{**_TEXT_DIMS, "num_attention_heads": heads[0], "num_key_value_heads": heads[1]},
    )
    model = _chat_lm(seed_weights(Qwen2ForCausalLM(config), "qwen2"), tokenizer)

    yield "save"
    model.save_pretrained(out)


# --- qwen2.5-omni --------------------------------------------------------------------------


def _omni_config(tokenizer) -> tuple[Any, dict[str, int]]:
    """The tiny Qwen2_5OmniConfig and the speaker bos ids, from the omni tokenizer.

    Like the real checkpoint, the thinker's vocabulary extends past the tokenizer; the
    talker's text-side tokens (tts pad/bos/eos) and the speakers' bos tokens live there.
    """
    from transformers import Qwen2_5OmniConfig

    ids = _special_ids(tokenizer)
    tail = iter(range(len(tokenizer), len(tokenizer) + 3 + len(OMNI_SPEAKERS)))
    tts_pad, tts_bos, tts_eos = next(tail), next(tail), next(tail)
    speaker_bos = {speaker: next(tail) for speaker in OMNI_SPEAKERS}
    vocab_size = _round_up(len(tokenizer) + 3 + len(OMNI_SPEAKERS), 64)
    media = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
        "vision_end_token_id": ids["<|vision_eos|>"],
    }
    thinker = {
        "text_config": {
            **_TEXT_DIMS,
            "vocab_size": vocab_size,
            "rope_parameters": _MROPE,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        "audio_config": {
            # 128 mel bins, as WhisperFeatureExtractor(feature_size=128) computes them.
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "output_dim": _TEXT_DIMS["hidden_size"],
        },
        "vision_config": {**_VISION_DIMS, "out_hidden_size": _TEXT_DIMS["hidden_size"]},
        "user_token_id": tokenizer.convert_tokens_to_ids("user"),
        **media,
    }
    # The real codec vocabulary is 8448 with pad, bos, eos at 8292..8294 and mask at 8296
    # after 8192 codes; here 160 with the same specials at 128..132 after 128 codes.
    talker = {
        "vocab_size": 160,
        "tts_codec_pad_token_id": _CODEBOOK_SIZE,
        "tts_codec_start_token_id": _CODEBOOK_SIZE + 1,
        "tts_codec_end_token_id": _CODEBOOK_SIZE + 2,
        "tts_codec_mask_token_id": _CODEBOOK_SIZE + 4,
        "tts_text_pad_token_id": tts_pad,
        "tts_text_start_token_id": tts_bos,
        "tts_text_end_token_id": tts_eos,
        # The talker reads thinker embeddings and hidden states: its input width is the
        # thinker's; its own decoder is narrower, as in the real 3584 -> 896.
        "embedding_size": _TEXT_DIMS["hidden_size"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_parameters": _MROPE,
        "max_position_embeddings": 4096,
        **media,
    }
    token2wav = {
        "dit_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 16,
            "ff_mult": 2,
            "emb_dim": 16,
            "block_size": 24,
            "look_ahead_layers": [1],
            "look_backward_layers": [0],
            "repeats": 2,
            "num_embeds": _CODEBOOK_SIZE,
            "mel_dim": 80,
            "enc_emb_dim": 16,
            "enc_dim": 16,
            # The ECAPA speaker encoder aggregates its three middle blocks: last = 3 x 16.
            "enc_channels": [16, 16, 16, 16, 48],
            "enc_attention_channels": 16,
            "enc_se_channels": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "max_position_embeddings": 4096,
            "dropout": 0.0,
        },
        "bigvgan_config": {
            "mel_dim": 80,
            # 128 channels halve over the real six upsampling layers (x240) to 2.
            "upsample_initial_channel": 128,
            "resblock_kernel_sizes": [3],
            "resblock_dilation_sizes": [[1, 3, 5]],
        },
    }
    config = Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav
    )
    return config, speaker_bos


def _speaker_map(speaker_bos: dict[str, int], dit: Any) -> dict[str, dict[str, Any]]:
    """spk_dict.pt: per speaker, its bos token, speaker embedding and reference mel."""
    return {
        speaker: {
            "bos_token": bos,
            "cond": portable_uniform(f"qwen2.5-omni/spk/{speaker}/cond", (dit.enc_emb_dim,), 1.0),
            # Log-mel values around -4, as real log-mel frames of speech sit.
            "ref_mel": portable_uniform(
                f"qwen2.5-omni/spk/{speaker}/ref_mel", (1, 48, dit.mel_dim), 3.0, -4.0
            ),
        }
        for speaker, bos in speaker_bos.items()
    }


def _build_omni(out: Path) -> Iterator[str]:
    from transformers import Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

    yield "tokenizer"
    tokenizer = build_tokenizer("omni")
    tokenizer.save_pretrained(out)
    # The audio front end; the processor that would bundle it needs torchvision.
    WhisperFeatureExtractor(feature_size=128, return_attention_mask=True).save_pretrained(out)

    yield "model"
    config, speaker_bos = _omni_config(tokenizer)
    model = Qwen2_5OmniForConditionalGeneration(config)

    yield "weights"
    for part in ("thinker", "talker", "token2wav"):
        seed_weights(getattr(model, part), f"qwen2.5-omni/{part}")
    model.eval()
    # conv_post's output std is 64 with these weights: 0.005 brings it to about 0.3.
    _scale_output(model.token2wav.code2wav_bigvgan_model.conv_post, 0.005)
    _silence_rows(model.thinker.lm_head.weight, len(tokenizer))
    # Like the real talker, emit only codes and the pad/bos/eos ids after them (bos is
    # suppressed by generate), never the mask or unused ids: token2wav embeds codes only.
    _silence_rows(model.talker.codec_head.weight, config.talker_config.tts_codec_end_token_id + 1)

    yield "speakers"
    speakers = _speaker_map(speaker_bos, config.token2wav_config.dit_config)
    # from_pretrained requires spk_dict.pt beside the weights.
    torch.save(speakers, out / "spk_dict.pt")

    yield "save"
    model.save_pretrained(out)


# --- qwen2.5-vl ----------------------------------------------------------------------------

# Qwen2.5-VL's published preprocessor_config.json: images are resized to between 4 and
# 16384 merged 28 x 28 patches.
_VL_MIN_PIXELS = 56 * 56
_VL_MAX_PIXELS = 28 * 28 * 16384


def _qwen_vl_config(tokenizer, **text: Any):
    """A tiny Qwen2_5_VLConfig over the qwen tokenizer; `text` adds text-config keys."""
    from transformers import Qwen2_5_VLConfig

    ids = _special_ids(tokenizer)
    return Qwen2_5_VLConfig(
        text_config={
            **_TEXT_DIMS,
            "vocab_size": _round_up(len(tokenizer), 64),
            "rope_parameters": _MROPE,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            **text,
        },
        vision_config={**_VISION_DIMS, "out_hidden_size": _TEXT_DIMS["hidden_size"]},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )


def _build_qwen_vl(out: Path) -> Iterator[str]:
    from transformers import (
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    ids = _special_ids(tokenizer)
    tokenizer.save_pretrained(out)
    # The PIL image processor saves as `Qwen2VLImageProcessor`, as the real checkpoint's
    # does; the processor that would bundle it with the tokenizer needs torchvision.
    Qwen2VLImageProcessorPil(min_pixels=_VL_MIN_PIXELS, max_pixels=_VL_MAX_PIXELS).save_pretrained(
        out
    )

    yield "model"
    config = _qwen_vl_config(tokenizer, bos_token_id=ids["<|endoftext|>"])
    model = _chat_lm(
        seed_weights(Qwen2_5_VLForConditionalGeneration(config), "qwen2.5-vl"), tokenizer
    )

    yield "save"
    model.save_pretrained(out)


# --- text-to-image -------------------------------------------------------------------------

# Qwen-Image's published scheduler_config.json.
QWEN_IMAGE_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
# The first 4 of Qwen-Image's 16 published latent channel statistics.
_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075]
_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558]


def _qwen_image_models(recipe: str, tokenizer) -> Generator[str, None, tuple[Any, Any, Any]]:
    """Qwen-Image's text encoder, transformer and VAE, tiny, seeded under `recipe`; yields
    each part's label before building it and returns the three models."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    yield "text_encoder"
    text_encoder = seed_weights(
        Qwen2_5_VLForConditionalGeneration(_qwen_vl_config(tokenizer)), f"{recipe}/text_encoder"
    )

    yield "transformer"
    latent_channels = len(_LATENTS_MEAN)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=latent_channels * 4,
        out_channels=latent_channels,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_TEXT_DIMS["hidden_size"],
        # RoPE dims per (frame, height, width) axis sum to the head dim, as (16, 56, 56).
        axes_dims_rope=(4, 6, 6),
    )
    seed_weights(transformer, f"{recipe}/transformer")

    yield "vae"
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=latent_channels,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=_LATENTS_MEAN,
        latents_std=_LATENTS_STD,
    )
    seed_weights(vae, f"{recipe}/vae")
    return text_encoder, transformer, vae


def _build_text_to_image(out: Path) -> Iterator[str]:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    text_encoder, transformer, vae = yield from _qwen_image_models("text-to-image", tokenizer)

    yield "save"
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipeline.save_pretrained(out)


# --- image-edit ----------------------------------------------------------------------------

# Where QwenImageEditPipeline keeps its Qwen2VLProcessor: a folder of the tokenizer and the
# image processor, as in the published checkpoint.
EDIT_PROCESSOR = "processor"


def _build_image_edit(out: Path) -> Iterator[str]:
    """QwenImageEditPipeline: Qwen-Image's parts, plus the processor that shows the text
    encoder the input image.

    diffusers saves every part but the processor: Qwen2VLProcessor cannot be constructed
    without torchvision (its video processor's class check), which omniflow does not
    require. So the pipeline is saved without it, and the processor's folder and index entry
    are written as the real checkpoint has them: the tokenizer and Qwen2.5-VL's image
    processor in `processor/`, `"processor": ["transformers", "Qwen2VLProcessor"]`.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessorPil

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen", EDIT_CORPUS)
    text_encoder, transformer, vae = yield from _qwen_image_models("image-edit", tokenizer)

    yield "processor"
    tokenizer.save_pretrained(out / EDIT_PROCESSOR)
    # Saved as `Qwen2VLImageProcessor`, as for qwen2.5-vl.
    image_processor = Qwen2VLImageProcessorPil(min_pixels=_VL_MIN_PIXELS, max_pixels=_VL_MAX_PIXELS)
    image_processor.save_pretrained(out / EDIT_PROCESSOR)

    yield "save"
    pipeline = QwenImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=None,
        transformer=transformer,
    )
    pipeline.save_pretrained(out)
    index_file = out / "model_index.json"
    index = json.loads(index_file.read_text(encoding="utf-8"))
    index[EDIT_PROCESSOR] = ["transformers", "Qwen2VLProcessor"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --- tts -----------------------------------------------------------------------------------


def _tts_layout(tokenizer) -> dict[str, Any]:
    """Where codec tokens sit in the tts talker's vocabulary, after the text tokens."""
    offset = _round_up(len(tokenizer), 64)
    after = offset + _CODEBOOK_SIZE
    return {
        "codec_token_offset": offset,
        "codebook_size": _CODEBOOK_SIZE,
        "codec_bos_token_id": after,
        "codec_eos_token_id": after + 1,
        "codec_pad_token_id": after + 2,
        "speakers": {speaker: after + 3 + i for i, speaker in enumerate(TTS_SPEAKERS)},
        "vocab_size": _round_up(after + 3 + len(TTS_SPEAKERS), 64),
    }


def _build_tts(out: Path) -> Iterator[str]:
    from transformers import DacConfig, DacModel, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    layout = _tts_layout(tokenizer)
    tokenizer.save_pretrained(out / "talker")

    yield "talker"
    codes = range(layout["codec_token_offset"], layout["codec_token_offset"] + _CODEBOOK_SIZE)
    config = Qwen3Config(
        vocab_size=layout["vocab_size"],
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=layout["codec_bos_token_id"],
        eos_token_id=layout["codec_eos_token_id"],
        pad_token_id=layout["codec_pad_token_id"],
        **_TEXT_DIMS,
    )
    talker = seed_weights(Qwen3ForCausalLM(config), "tts/talker")
    # The talker reads text but speaks only codec tokens: generate() suppresses the rest.
    allowed = {*codes, layout["codec_eos_token_id"]}
    talker.generation_config = GenerationConfig(
        bos_token_id=layout["codec_bos_token_id"],
        eos_token_id=layout["codec_eos_token_id"],
        pad_token_id=layout["codec_pad_token_id"],
        suppress_tokens=[i for i in range(layout["vocab_size"]) if i not in allowed],
        do_sample=False,
    )
    talker.save_pretrained(out / "talker")

    yield "code2wav"
    codec_config = DacConfig(
        encoder_hidden_size=4,
        # x1920 at 24 kHz: 12.5 codec frames a second, as Qwen3-TTS-12Hz's tokenizer.
        downsampling_ratios=[4, 6, 8, 10],
        decoder_hidden_size=64,
        n_codebooks=1,
        codebook_size=_CODEBOOK_SIZE,
        codebook_dim=8,
        sampling_rate=_SAMPLE_RATE,
    )
    code2wav = seed_weights(DacModel(codec_config), "tts/code2wav")
    # The decoder's last conv has output std 7.4 with these weights: 0.04 brings it to 0.3.
    _scale_output(code2wav.decoder.conv2, 0.04)
    code2wav.save_pretrained(out / "code2wav")

    yield "index"
    index = {
        "_class_name": "OmniflowTinyTTS",
        "talker": ["transformers", "Qwen3ForCausalLM"],
        "code2wav": ["transformers", "DacModel"],
        "tokenizer_subfolder": "talker",
        "text_template": TTS_TEXT_TEMPLATE,
        **{k: v for k, v in layout.items() if k != "vocab_size"},
        "num_code_groups": 1,
        "sample_rate": _SAMPLE_RATE,
        "samples_per_frame": codec_config.hop_length,
    }
    (out / TTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _build_qwen3_omni(out: Path) -> Iterator[str]:
    # The family's own recipe (imported here lazily: it builds on this module).
    from omniflow.families.qwen3_omni.checkpoints import build_tiny

    yield from build_tiny(out)


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "qwen2",
            "Qwen2ForCausalLM: 2-layer, 64-wide Qwen2.5-style chat LM with tied embeddings",
            ("tokenizer", "model", "save"),
            _build_qwen2,
        ),
        Recipe(
            "qwen2-wide-heads",
            "the qwen2 weights split into 2 attention heads of 32 (vLLM's CPU attention needs >= 32)",
            ("tokenizer", "model", "save"),
            partial(_build_qwen2, heads=(2, 1)),
        ),
        Recipe(
            "qwen2.5-omni",
            "Qwen2_5OmniForConditionalGeneration: thinker (with audio and vision towers), "
            "talker and token2wav (DiT + BigVGAN), with spk_dict.pt",
            ("tokenizer", "model", "weights", "speakers", "save"),
            _build_omni,
        ),
        Recipe(
            "qwen2.5-vl",
            "Qwen2_5_VLForConditionalGeneration: vision tower (2 blocks, 14 px patches) and "
            "a 2-layer, 64-wide decoder with multimodal RoPE, with its image processor",
            ("tokenizer", "model", "save"),
            _build_qwen_vl,
        ),
        Recipe(
            "text-to-image",
            "QwenImagePipeline: Qwen2.5-VL text encoder, QwenImageTransformer2DModel, "
            "AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler",
            ("tokenizer", "text_encoder", "transformer", "vae", "save"),
            _build_text_to_image,
        ),
        Recipe(
            "image-edit",
            "QwenImageEditPipeline: the text-to-image parts (its own weights) and the "
            "Qwen2VLProcessor that shows the text encoder the input image",
            ("tokenizer", "text_encoder", "transformer", "vae", "processor", "save"),
            _build_image_edit,
        ),
        Recipe(
            "tts",
            "codec-LM TTS: Qwen3ForCausalLM talker over text + codec tokens, DacModel "
            "code2wav (1 codebook, 24 kHz, 12.5 frames/s)",
            ("tokenizer", "talker", "code2wav", "index"),
            _build_tts,
        ),
        Recipe(
            "qwen3-omni",
            "Qwen3OmniMoeForConditionalGeneration: MoE thinker (with audio and vision towers), "
            "MoE talker with its 5-layer code predictor over 16 codebooks, causal ConvNet "
            "code2wav (x1920, 24 kHz)",
            ("tokenizer", "model", "weights", "save"),
            _build_qwen3_omni,
        ),
    )
}

"""Random-weight Qwen3-TTS-12Hz checkpoints in the published layout.

A checkpoint folder, as on the hub:

```
config.json               qwen3_tts: talker_config (code_predictor_config), speaker_encoder_config
                          (Base), tts_model_type, the text-side special ids
generation_config.json    the talker's and the sub-talker's sampling defaults
model.safetensors         talker.* (and speaker_encoder.* for Base), the reference's names
vocab.json merges.txt tokenizer_config.json ...   the text tokenizer (Qwen2Tokenizer)
speech_tokenizer/
  config.json             qwen3_tts_tokenizer_12hz: encoder_config (Mimi), decoder_config
  preprocessor_config.json  EncodecFeatureExtractor at 24 kHz
  model.safetensors       encoder.* (MimiModel's encoder side), decoder.*
```

Tiny checkpoints (`tiny:qwen3-tts-customvoice`, `-voicedesign`, `-base`) keep the real
layout of ids: codebook 0's codes, then the specials at the real offsets past the codebook
(pad +100, bos +101, eos +102, think +106 ...), languages +2..+26 and the nine CustomVoice
speakers +813..+1018, in a vocabulary of codebook + 1024 (the reference suppresses the top
1024 ids); the text-side ids follow the tiny tokenizer's 699. Every width is small, every
structure real: 16 code groups, a code predictor narrower than the talker (its input
projection exists, as in 1.7B), the decoder's x8 x5 x4 x3 and x2 x2 upsampling (1920
samples a frame at 24 kHz), a 12.5 Hz Mimi encoder.

`build_scaled(out, task, depth)` writes the published 1.7B configuration (catalog copy of
the real config) with random bf16 weights, on the tiny tokenizer; its codec head's
end-of-speech row is zeroed so random weights speak to the token limit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from omniflow.checkpoints.tiny_recipes import portable_uniform, seed_weights
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer
from omniflow.families.qwen3_tts import REAL_MODELS

TASK_TYPES = {"customvoice": "custom_voice", "voicedesign": "voice_design", "base": "base"}
# The published ids, as offsets past codebook 0's 2048 codes.
_REAL_CODES = 2048
_SPECIALS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
LANGUAGES = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
    "beijing_dialect": 2074,
    "sichuan_dialect": 2062,
}
SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
DIALECTS = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
GENERATION = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "max_new_tokens": 8192,
}
FEATURE_EXTRACTOR = {
    "chunk_length_s": None,
    "feature_extractor_type": "EncodecFeatureExtractor",
    "feature_size": 1,
    "overlap": None,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 24000,
}

_TINY_CODES = 128
_TINY = {
    "talker": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "text_hidden_size": 48,
        "max_position_embeddings": 4096,
    },
    "code_predictor": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 4096,
    },
    "speaker_encoder": {
        "enc_channels": [32, 32, 32, 32, 96],
        "enc_attention_channels": 16,
        "enc_se_channels": 16,
    },
    "decoder": {
        "codebook_dim": 32,
        "latent_dim": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_hidden_layers": 2,
        "sliding_window": 6,
        "decoder_dim": 64,
        "max_position_embeddings": 8000,
    },
    "encoder": {
        "hidden_size": 32,
        "num_filters": 4,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 64,
        "codebook_dim": 16,
        "vector_quantization_hidden_dimension": 16,
        "num_quantizers": 16,
        "upsample_groups": 32,
    },
}
# The decoder's last conv scaled so the tiny waveform's std is about 0.3 (see _scale_output
# in tiny_recipes: unscaled, the final clamp saturates it): measured for these weights.
_TINY_OUTPUT_GAIN = 0.023


def _layout(codes: int) -> dict[str, Any]:
    """The talker's special ids, languages and speakers for a codebook of `codes`."""

    def shift(i: int) -> int:
        return i - _REAL_CODES + codes

    return {
        **{k: shift(v) for k, v in _SPECIALS.items()},
        "codec_language_id": {k: shift(v) for k, v in LANGUAGES.items()},
        "spk_id": {k: [shift(v)] for k, v in SPEAKERS.items()},
        "spk_is_dialect": {k: DIALECTS.get(k, False) for k in SPEAKERS},
        "vocab_size": codes + 1024,
    }


def tiny_config(task: str, tokenizer) -> tuple[dict, dict]:
    """(config.json, speech_tokenizer/config.json) of a tiny checkpoint of `task`."""
    text_ids = len(tokenizer)
    layout = _layout(_TINY_CODES)
    if task != "customvoice":  # only CustomVoice checkpoints name speakers
        layout["spk_id"], layout["spk_is_dialect"] = {}, {}
    talker = {
        "model_type": "qwen3_tts_talker",
        **_TINY["talker"],
        **layout,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": {"interleaved": True, "mrope_section": [2, 3, 3], "rope_type": "default"},
        "num_code_groups": 16,
        "position_id_per_seconds": 13,
        "text_vocab_size": -(-(text_ids + 3) // 64) * 64,
        "code_predictor_config": {
            "model_type": "qwen3_tts_talker_code_predictor",
            **_TINY["code_predictor"],
            "vocab_size": _TINY_CODES,
            "num_code_groups": 16,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000,
        },
    }
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    config = {
        "architectures": ["Qwen3TTSForConditionalGeneration"],
        "model_type": "qwen3_tts",
        "tts_model_type": TASK_TYPES[task],
        "tts_model_size": "1b7",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "im_start_token_id": ids["<|im_start|>"],
        "im_end_token_id": ids["<|im_end|>"],
        "tts_pad_token_id": text_ids,
        "tts_bos_token_id": text_ids + 1,
        "tts_eos_token_id": text_ids + 2,
        "talker_config": talker,
        "torch_dtype": "float32",
    }
    if task == "base":
        config["speaker_encoder_config"] = {
            **_TINY["speaker_encoder"],
            "enc_dim": _TINY["talker"]["hidden_size"],
            "sample_rate": 24000,
        }
    speech = {
        "architectures": ["Qwen3TTSTokenizerV2Model"],
        "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16,
        "input_sample_rate": 24000,
        "output_sample_rate": 24000,
        "decode_upsample_rate": 1920,
        "encode_downsample_rate": 1920,
        "encoder_config": {**_TINY["encoder"], "codebook_size": _TINY_CODES, "_frame_rate": 12.5},
        "decoder_config": {
            **_TINY["decoder"],
            "codebook_size": _TINY_CODES,
            "num_quantizers": 16,
            "num_semantic_quantizers": 1,
            "upsample_rates": [8, 5, 4, 3],
            "upsampling_ratios": [2, 2],
            "hidden_act": "silu",
            "attention_bias": False,
            "layer_scale_initial_scale": 0.01,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000,
        },
    }
    return config, speech


# --- weights -------------------------------------------------------------------------------


def _redraw(tensor: torch.Tensor, key: str, bound: float, center: float = 0.0) -> None:
    with torch.no_grad():
        tensor.copy_(portable_uniform(key, tuple(tensor.shape), bound, center))


def _seed_decoder(decoder, key: str) -> None:
    """Portable random weights for the speech decoder, codebooks and scales included (the
    architecture makes codewords zero, layer scales 0.01 and ConvNeXt's 1e-6: constants
    that would hide the codes and the blocks)."""
    seed_weights(decoder, key)
    params = dict(decoder.named_parameters())
    for name, param in params.items():
        if name.endswith(".bias") and param.numel() == 1:  # one value: seed_weights keeps it
            weight = params[name.removesuffix("bias") + "weight"]
            _redraw(param, f"{key}/{name}", 1.0 / math.sqrt(weight.numel() // weight.shape[0]))
        elif name.endswith("embedding_sum"):
            _redraw(param, f"{key}/{name}", 1.0)
        elif name.endswith("cluster_usage"):
            _redraw(param, f"{key}/{name}", 0.5, 1.0)
        elif name.endswith(("layer_scale.scale", "gamma")):
            _redraw(param, f"{key}/{name}", 0.05, 0.1)
        elif name.endswith((".alpha", ".beta")):
            _redraw(param, f"{key}/{name}", 0.2)


def _seed_mimi(encoder, key: str) -> None:
    seed_weights(encoder, key)
    for name, buffer in encoder.named_buffers():
        if name.endswith("embed_sum"):
            _redraw(buffer, f"{key}/{name}", 1.0)
        elif name.endswith("cluster_usage"):
            _redraw(buffer, f"{key}/{name}", 0.5, 1.0)


def _talker_tensors(talker) -> dict[str, torch.Tensor]:
    from omniflow.families.qwen3_tts.modeling import _TALKER_RENAMES

    back = {v: k for k, v in _TALKER_RENAMES.items()}
    return {f"talker.{back.get(k, k)}": v.contiguous() for k, v in talker.state_dict().items()}


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(
        {k: v.contiguous() for k, v in sorted(tensors.items())},
        str(path),
        metadata={"format": "pt"},
    )


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_tiny(out: Path, task: str):
    """Write the tiny `task` checkpoint (customvoice, voicedesign, base) into `out`;
    yields the label of each part before building it."""
    from omniflow.families.qwen3_tts.config import TTSConfig
    from omniflow.families.qwen3_tts.modeling import Talker, build_speaker_encoder
    from omniflow.families.qwen3_tts.speech_tokenizer import SpeechDecoder, SpeechEncoder

    name = f"qwen3-tts-{task}"
    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    config, speech = tiny_config(task, tokenizer)
    tokenizer.save_pretrained(out)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION)

    yield "talker"
    parsed = TTSConfig.of(config)
    talker = seed_weights(Talker(parsed), f"{name}/talker")
    tensors = _talker_tensors(talker)
    if task == "base":
        encoder = seed_weights(build_speaker_encoder(parsed), f"{name}/speaker_encoder")
        tensors.update({f"speaker_encoder.{k}": v for k, v in encoder.state_dict().items()})
    _save(tensors, out / "model.safetensors")

    yield "speech_tokenizer"
    decoder = SpeechDecoder(speech["decoder_config"])
    # One speech tokenizer for every task, as the published checkpoints share theirs.
    _seed_decoder(decoder, "qwen3-tts/speech_tokenizer/decoder")
    with torch.no_grad():
        for param in decoder.decoder[-1].parameters():
            param.mul_(_TINY_OUTPUT_GAIN)
    encoder = SpeechEncoder(speech)
    _seed_mimi(encoder.encoder, "qwen3-tts/speech_tokenizer/encoder")
    st = out / "speech_tokenizer"
    _write_json(st / "config.json", speech)
    _write_json(st / "preprocessor_config.json", FEATURE_EXTRACTOR)
    tensors = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    tensors.update({f"encoder.{k}": v for k, v in encoder.published_state().items()})
    _save(tensors, st / "model.safetensors")


def build_tiny_customvoice(out: Path):
    """`tiny:qwen3-tts-customvoice`'s recipe."""
    yield from build_tiny(out, "customvoice")


def build_tiny_voicedesign(out: Path):
    """`tiny:qwen3-tts-voicedesign`'s recipe."""
    yield from build_tiny(out, "voicedesign")


def build_tiny_base(out: Path):
    """`tiny:qwen3-tts-base`'s recipe."""
    yield from build_tiny(out, "base")


# --- real size ---------------------------------------------------------------------------


def scaled_config(task: str, depth: float, tokenizer) -> tuple[dict, dict]:
    """The published 1.7B configuration (the builtin catalog's copy of config.json and
    speech_tokenizer/config.json) with the real id layout, on the tiny tokenizer's text
    ids, each transformer's layers x `depth`."""
    from omniflow.catalog.components import builtin_files

    model = {
        "customvoice": REAL_MODELS["customvoice"],
        "voicedesign": REAL_MODELS["customvoice"],  # the same talker dims
        "base": REAL_MODELS["base"],
    }[task]
    files = builtin_files(model)
    config = json.loads(json.dumps(files["config.json"]))
    speech = json.loads(json.dumps(files["speech_tokenizer/config.json"]))
    config["tts_model_type"] = TASK_TYPES[task]
    talker = config["talker_config"]
    talker.update(_layout(_REAL_CODES))
    if task != "customvoice":
        talker["spk_id"], talker["spk_is_dialect"] = {}, {}
    for part in (talker, talker["code_predictor_config"], speech["decoder_config"]):
        part["num_hidden_layers"] = max(1, round(part["num_hidden_layers"] * depth))
    text_ids = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    config.update(
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=text_ids,
        tts_bos_token_id=text_ids + 1,
        tts_eos_token_id=text_ids + 2,
    )
    # The published Mimi encoder (speech_tokenizer's encoder_config is not in the catalog).
    speech.setdefault(
        "encoder_config",
        {
            "hidden_size": 512,
            "num_hidden_layers": max(1, round(8 * depth)),
            "num_quantizers": 32,
            "codebook_size": 2048,
            "codebook_dim": 256,
            "vector_quantization_hidden_dimension": 256,
            "sliding_window": 250,
            "_frame_rate": 12.5,
        },
    )
    return config, speech


def build_scaled(
    out: str | Path, task: str = "customvoice", depth: float = 1.0, device: str = "cuda"
) -> Path:
    """A real-size random-weight checkpoint of `task` in bf16 (decoder float32), built on
    `device`; end-of-speech silenced so generation runs to its token limit."""
    from omniflow.families.qwen3_tts.config import TTSConfig
    from omniflow.families.qwen3_tts.modeling import Talker, build_speaker_encoder
    from omniflow.families.qwen3_tts.speech_tokenizer import SpeechDecoder, SpeechEncoder

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer("qwen")
    config, speech = scaled_config(task, depth, tokenizer)
    config["torch_dtype"] = "bfloat16"
    tokenizer.save_pretrained(out)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", GENERATION)
    parsed = TTSConfig.of(config)
    with torch.device(device):
        talker = Talker(parsed).to(torch.bfloat16)
        _init_normal(talker)
        with torch.no_grad():
            talker.codec_head.weight[parsed.layout.codec_eos] = 0
        tensors = _talker_tensors(talker)
        if task == "base":
            encoder = build_speaker_encoder(parsed).to(torch.bfloat16)
            tensors.update({f"speaker_encoder.{k}": v for k, v in encoder.state_dict().items()})
        _save({k: v.cpu() for k, v in tensors.items()}, out / "model.safetensors")
        del talker, tensors
        decoder = SpeechDecoder(speech["decoder_config"])
        _init_normal(decoder)
        for name, param in decoder.named_parameters():
            if name.endswith("embedding_sum"):
                torch.nn.init.normal_(param)
        encoder = SpeechEncoder(speech)
        st = {f"decoder.{k}": v.cpu() for k, v in decoder.state_dict().items()}
        st.update({f"encoder.{k}": v.cpu() for k, v in encoder.published_state().items()})
    _write_json(out / "speech_tokenizer" / "config.json", speech)
    _write_json(out / "speech_tokenizer" / "preprocessor_config.json", FEATURE_EXTRACTOR)
    _save(st, out / "speech_tokenizer" / "model.safetensors")
    return out


def build_scaled_customvoice(out: str | Path, depth: float, device: str) -> Path:
    """`Family.scaled`'s builder of Qwen3-TTS-12Hz-1.7B-CustomVoice."""
    return build_scaled(out, "customvoice", depth, device)


def build_scaled_voicedesign(out: str | Path, depth: float, device: str) -> Path:
    """`Family.scaled`'s builder of Qwen3-TTS-12Hz-1.7B-VoiceDesign."""
    return build_scaled(out, "voicedesign", depth, device)


def build_scaled_base(out: str | Path, depth: float, device: str) -> Path:
    """`Family.scaled`'s builder of Qwen3-TTS-12Hz-1.7B-Base."""
    return build_scaled(out, "base", depth, device)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(math.prod(p.shape) for p in module.parameters())


def _init_normal(module: torch.nn.Module) -> None:
    """Untrained-model init (std 0.02 for matrices and embeddings, PyTorch's default
    elsewhere): real-size random weights for measuring, not listening."""
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.02)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m omniflow.families.qwen3_tts.checkpoints",
        description="build a real-size random-weight Qwen3-TTS-12Hz 1.7B checkpoint",
    )
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--task", choices=sorted(TASK_TYPES), default="customvoice")
    parser.add_argument(
        "--depth", type=float, default=1.0, help="layers x this (1: the real model)"
    )
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    print(build_scaled(args.out, args.task, args.depth, args.device))


if __name__ == "__main__":
    main()

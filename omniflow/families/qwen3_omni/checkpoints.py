"""Qwen3-Omni's checkpoints: the tiny one of the real architecture and the unsplit reference
run the staged pipeline is compared against. (`scaled` builds the real-size one.)

- `build_tiny` (`tiny:qwen3-omni`): `Qwen3OmniMoeForConditionalGeneration` from a config
  shrunk from the published one (the layer types and the structure kept: MoE thinker with
  its audio encoder and ViT, MoE talker with a shared expert and the 5-layer code predictor
  over 16 codebooks, the causal ConvNet code2wav with its sliding-window transformer and the
  real upsampling x1920), saved with `save_pretrained`, with its tokenizer, its processor's
  parts (the Whisper audio front end, the image processor with 16 px patches, the video
  processor's settings) and a greedy `generation_config.json`; it loads through
  `from_pretrained` as the real checkpoint does.
- `reference_generate`: the model's own `Qwen3OmniMoeForConditionalGeneration.generate`,
  with the talker's frames read off its own `generate`: the oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from omniflow.checkpoints.tiny_recipes import (
    round_up,
    scale_output,
    seed_weights,
    silence_rows,
    special_ids,
)
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer
from omniflow.families.qwen2_5_omni.checkpoints import watching_talker
from omniflow.families.qwen3_omni import (
    AUDIO_TOKENS,
    CODEBOOK_OFFSETS,
    SPEAKERS,
    TTS_TOKENS,
    chat_template,
)
from omniflow.hf_logging import quiet

NAME = "qwen3-omni"
# Tiny widths. The thinker: 64 wide, 2 layers of 4 routed experts (2 per token) with
# 4 query and 2 key/value heads of 16 dims; the talker reads its layer 1's hidden states
# (the real one reads layer 24 of 48).
_THINKER_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    # The real [24, 20, 20] of a 128-dim head's 64 frequency pairs, over a 16-dim head's 8.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1000000.0,
        "mrope_section": [3, 3, 2],
        "interleaved": True,
    },
}
ACCEPT_HIDDEN_LAYER = 1
# The talker: 32 wide, 2 MoE layers (4 experts, 2 per token, and the shared expert) with
# 2 query and 1 key/value heads of 16 dims; the code predictor keeps its 5 layers.
_TALKER_TEXT = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_parameters": _THINKER_TEXT["rope_parameters"],
}
# 16 codebooks of 128 codes (the real 2048). The talker's codec vocabulary keeps the real
# 1024 ids of specials after the codes: `generate` suppresses `vocab_size - 1024 ..` but
# the end of speech, which on a smaller vocabulary would suppress the codes too.
CODEBOOK = 128
NUM_CODE_GROUPS = 16
_CODE_PREDICTOR = {
    "hidden_size": _TALKER_TEXT["hidden_size"],
    "intermediate_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "vocab_size": CODEBOOK,
    "num_code_groups": NUM_CODE_GROUPS,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
# code2wav: 2 sliding-window layers (the real 8; the real 72-frame window), 32 wide, the real
# upsampling (x2 x2 by ConvNeXt stages, then x8 x5 x4 x3: 1920 samples per frame), decoder
# channels 32 halving to 2.
_CODE2WAV = {
    "codebook_size": CODEBOOK,
    "num_quantizers": NUM_CODE_GROUPS,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "sliding_window": 72,
    "layer_scale_initial_scale": 0.01,
    "rms_norm_eps": 1e-5,
    "upsample_rates": [8, 5, 4, 3],
    "upsampling_ratios": [2, 2],
    "decoder_dim": 32,
    "max_position_embeddings": 8000,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


# The image processor: the ViT's 16 px patches merged 2 x 2, two frames a temporal patch,
# mean and std 0.5 per channel, Qwen2.5-Omni's pixel bounds.
IMAGE_PROCESSOR = {
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
}
POSITION_ID_PER_SECONDS = 13


def tiny_tokenizer():
    """The tiny qwen tokenizer with Qwen3-Omni's own special tokens after Qwen's (as in the
    real vocabulary: the audio markers, the talker's text-side tokens, the audio pad) and
    Qwen3-Omni's chat template."""
    tokenizer = build_tokenizer("qwen")
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [*tokenizer.extra_special_tokens, *AUDIO_TOKENS, *TTS_TOKENS]}
    )
    tokenizer.chat_template = chat_template()
    return tokenizer


def tiny_config(tokenizer) -> Any:
    """The tiny `Qwen3OmniMoeConfig` over `tokenizer`'s ids."""
    from transformers import Qwen3OmniMoeConfig

    ids = special_ids(tokenizer)
    media = {
        "audio_token_id": ids["<|audio_pad|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }
    thinker = {
        "text_config": {
            **_THINKER_TEXT,
            "vocab_size": round_up(len(tokenizer), 64),
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        "audio_config": {
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "downsample_hidden_size": 16,
            "output_dim": _THINKER_TEXT["hidden_size"],
        },
        "vision_config": {
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": _THINKER_TEXT["hidden_size"],
            "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [0, 1],
        },
        "user_token_id": tokenizer.convert_tokens_to_ids("user"),
        # The processor's (Qwen3OmniMoeProcessor.position_id_per_seconds), which its
        # interleaving of a video with its audio track and the model's positions share.
        "position_id_per_seconds": POSITION_ID_PER_SECONDS,
        **media,
    }
    codec = {name: CODEBOOK + offset for name, offset in CODEBOOK_OFFSETS.items()}
    talker = {
        "text_config": {**_TALKER_TEXT, "vocab_size": CODEBOOK + 1024},
        "code_predictor_config": _CODE_PREDICTOR,
        "num_code_groups": NUM_CODE_GROUPS,
        "thinker_hidden_size": _THINKER_TEXT["hidden_size"],
        "accept_hidden_layer": ACCEPT_HIDDEN_LAYER,
        "spatial_merge_size": 2,
        "position_id_per_seconds": POSITION_ID_PER_SECONDS,
        "speaker_id": {s: CODEBOOK + offset for s, offset in SPEAKERS.items()},
        **{k: v for k, v in codec.items() if k != "speaker"},
        **media,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=_CODE2WAV,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"],
        tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"],
        system_token_id=tokenizer.convert_tokens_to_ids("system"),
        user_token_id=tokenizer.convert_tokens_to_ids("user"),
        assistant_token_id=tokenizer.convert_tokens_to_ids("assistant"),
    )


def build_tiny(out: Path) -> Iterator[str]:
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    from omniflow.families.qwen2_5_omni.checkpoints import save_processor_parts
    from omniflow.families.qwen3_omni.towers import VIDEO_DEFAULTS

    yield "tokenizer"
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(out)
    # The processor's parts (the processor that would bundle them needs torchvision).
    save_processor_parts(out, IMAGE_PROCESSOR, VIDEO_DEFAULTS)

    yield "model"
    config = tiny_config(tokenizer)
    model = Qwen3OmniMoeForConditionalGeneration(config)

    yield "weights"
    for part in ("thinker", "talker", "code2wav"):
        seed_weights(getattr(model, part), f"{NAME}/{part}")
    model.eval()
    # The last conv's output std is 12.4 with these weights: 0.024 brings it to about 0.3.
    scale_output(model.code2wav.decoder[-1].conv, 0.024)
    # The thinker emits the tokenizer's text and chat ids only, never the talker's
    # text-side or the audio tokens (nor ids past the tokenizer), as the real one.
    ids = special_ids(tokenizer)
    silence_rows(model.thinker.lm_head.weight, ids[AUDIO_TOKENS[0]])
    ids = special_ids(tokenizer)
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )

    yield "save"
    model.save_pretrained(out)


# --- the reference ---------------------------------------------------------------------------


class Reference(NamedTuple):
    """What `reference_generate` returns.

    text_ids: the generated text tokens (prompt excluded), (n,) int64; text: them decoded,
    special tokens skipped; codes: the talker's frames as `generate` makes them, (frames, 16)
    int64, each row the talker's first codebook and the code predictor's 15; waveform:
    code2wav's 24 kHz audio of those frames, (samples,) float32.
    """

    text_ids: torch.Tensor
    text: str
    codes: torch.Tensor
    waveform: torch.Tensor


def prompt_ids(tokenizer, messages: list[dict] | str) -> torch.Tensor:
    """(1, n) input ids of a chat (a string: one user turn) with the generation prompt."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def reference_generate(
    model_dir: str | Path,
    messages: list[dict] | str,
    max_new_tokens: int = 16,
    *,
    speaker: str = "Ethan",
    talker_max_new_tokens: int = 32,
    model=None,
    input_ids: torch.Tensor | None = None,
    **generate_kwargs,
) -> Reference:
    """`Qwen3OmniMoeForConditionalGeneration.generate` on one chat: greedy thinker and
    talker (the code predictor follows the talker's `do_sample`), otherwise the class's
    defaults (the talker's repetition penalty 1.05, code2wav's `chunked_decode`); extra
    keyword arguments pass through (`talker_repetition_penalty=1.0`, the processor's media
    inputs, ...); `input_ids` (the processor's, its placeholders expanded) replace the
    chat's own.

    Not the literal defaults: the thinker's end of turn is this checkpoint's `<|im_end|>`
    (the class hard-codes the real 151645), and the frames are read off the talker's
    `generate` during the call (`generate` returns only text and audio). A talker stopped
    by `talker_max_new_tokens` gives one frame fewer than that: its last first-codebook
    token is never fed back, and the code predictor runs in the step that feeds it.
    """
    from transformers import AutoTokenizer, Qwen3OmniMoeForConditionalGeneration

    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if model is None:
            model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(model_dir).eval()
    if input_ids is None:
        input_ids = prompt_ids(tokenizer, messages)
    frames = []

    def keep(kwargs, result):
        frames.extend(hid[-1] for hid in result.hidden_states if hid[-1] is not None)

    with watching_talker(model, keep), quiet():
        sequences, waveform = model.generate(
            input_ids,
            speaker=speaker,
            thinker_max_new_tokens=max_new_tokens,
            thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False,
            talker_max_new_tokens=talker_max_new_tokens,
            talker_do_sample=False,
            **generate_kwargs,
        )
    text_ids = sequences[0, input_ids.shape[1] :]
    codes = torch.cat(frames) if frames else torch.zeros(0, NUM_CODE_GROUPS, dtype=torch.int64)
    text = tokenizer.decode(text_ids, skip_special_tokens=True)
    return Reference(text_ids, text, codes, waveform.reshape(-1))

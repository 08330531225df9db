"""The tiny codec-LM TTS (`tiny:tts`): a `Qwen3ForCausalLM` talker over text and codec
tokens, a `DacModel` code2wav (one codebook, 24 kHz, 12.5 frames a second), and a
`model_index.json` naming the parts and the codec-token layout; and the unsplit reference
run, the talker's own `generate` then the codec's whole decode.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from omniflow.checkpoints.tiny_recipes import (
    CODEBOOK_SIZE,
    SAMPLE_RATE,
    TEXT_DIMS,
    round_up,
    scale_output,
    seed_weights,
)
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer
from omniflow.hf_logging import quiet

TTS_SPEAKERS = ("Vivian", "Ryan")
# The checkpoint's top-level index, naming its parts (diffusers' model_index.json form).
TTS_INDEX = "model_index.json"
# How the talker sees the text it speaks; `{text}` is replaced by the request's text.
TTS_TEXT_TEMPLATE = "<|im_start|>assistant\n{text}<|im_end|>\n"


def tts_layout(tokenizer) -> dict[str, Any]:
    """Where codec tokens sit in the tts talker's vocabulary, after the text tokens."""
    offset = round_up(len(tokenizer), 64)
    after = offset + CODEBOOK_SIZE
    return {
        "codec_token_offset": offset,
        "codebook_size": CODEBOOK_SIZE,
        "codec_bos_token_id": after,
        "codec_eos_token_id": after + 1,
        "codec_pad_token_id": after + 2,
        "speakers": {speaker: after + 3 + i for i, speaker in enumerate(TTS_SPEAKERS)},
        "vocab_size": round_up(after + 3 + len(TTS_SPEAKERS), 64),
    }


def build_tiny(out: Path) -> Iterator[str]:
    from transformers import DacConfig, DacModel, GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    layout = tts_layout(tokenizer)
    tokenizer.save_pretrained(out / "talker")

    yield "talker"
    codes = range(layout["codec_token_offset"], layout["codec_token_offset"] + CODEBOOK_SIZE)
    config = Qwen3Config(
        vocab_size=layout["vocab_size"],
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        bos_token_id=layout["codec_bos_token_id"],
        eos_token_id=layout["codec_eos_token_id"],
        pad_token_id=layout["codec_pad_token_id"],
        **TEXT_DIMS,
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
        codebook_size=CODEBOOK_SIZE,
        codebook_dim=8,
        sampling_rate=SAMPLE_RATE,
    )
    code2wav = seed_weights(DacModel(codec_config), "tts/code2wav")
    # The decoder's last conv has output std 7.4 with these weights: 0.04 brings it to 0.3.
    scale_output(code2wav.decoder.conv2, 0.04)
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
        "sample_rate": SAMPLE_RATE,
        "samples_per_frame": codec_config.hop_length,
    }
    (out / TTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


# --- the unsplit reference ---


class TTSReference(NamedTuple):
    """What `reference_tts` returns.

    codes: the codec frames (one codebook), ids in the codec's own 0..codebook_size-1
    range, shape (frames,), int64. waveform: the decoded 24 kHz audio, (samples,), float32.
    """

    codes: torch.Tensor
    waveform: torch.Tensor


def read_tts_index(model_dir: str | Path) -> dict:
    """The tts checkpoint's index: its parts and its codec-token layout."""
    return json.loads((Path(model_dir) / TTS_INDEX).read_text(encoding="utf-8"))


def tts_prompt_ids(model_dir: str | Path, tokenizer, text: str, voice: str) -> torch.Tensor:
    """The (1, n) talker input ids for `text` in `voice`: text, speaker token, codec bos."""
    index = read_tts_index(model_dir)
    if voice not in index["speakers"]:
        raise KeyError(f"unknown voice '{voice}' (known: {', '.join(index['speakers'])})")
    text_ids = tokenizer(index["text_template"].format(text=text)).input_ids
    ids = [*text_ids, index["speakers"][voice], index["codec_bos_token_id"]]
    return torch.tensor([ids])


@torch.no_grad()
def reference_tts(
    model_dir: str | Path, text: str, voice: str = "Vivian", max_new_tokens: int = 32
) -> TTSReference:
    """The unsplit tts pipeline: the talker generates codes greedily, code2wav decodes all.

    The talker's generation config suppresses every id but codec tokens and the codec
    end-of-speech id, so `generate` emits only codes until it stops.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    index = read_tts_index(model_dir)
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir / index["tokenizer_subfolder"])
        talker = AutoModelForCausalLM.from_pretrained(model_dir / "talker").eval()
        code2wav = AutoModel.from_pretrained(model_dir / "code2wav").eval()
    input_ids = tts_prompt_ids(model_dir, tokenizer, text, voice)
    generated = talker.generate(input_ids, max_new_tokens=max_new_tokens)[0, input_ids.shape[1] :]
    codes = generated[generated != index["codec_eos_token_id"]] - index["codec_token_offset"]
    waveform = code2wav.decode(audio_codes=codes.view(1, 1, -1)).audio_values
    return TTSReference(codes, waveform.reshape(-1))

"""Qwen2.5-Omni's checkpoints: the tiny one of the real architecture, the unsplit reference
run the staged pipeline is compared against, and the real-size random-weight builds.

- `build_tiny` (`tiny:qwen2.5-omni`): `Qwen2_5OmniForConditionalGeneration`, thinker (with
  its audio and vision towers), talker and token2wav (DiT + BigVGAN), with `spk_dict.pt`.
- `reference_omni_generate`: the model's own `generate`, the oracle.
- `build_scaled_omni` (`scaled_checkpoint("Qwen/Qwen2.5-Omni-7B", depth)`), and
  `scaled_token2wav` / `scaled_stage`: one part of it, for measuring a stage alone.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch

from omniflow.catalog.components import builtin_files
from omniflow.checkpoints.scaled import (
    MANIFEST,
    check_depth,
    initialising_bf16_on,
    scale_into,
)
from omniflow.checkpoints.tiny import cache_root
from omniflow.checkpoints.tiny_recipes import (
    CODEBOOK_SIZE,
    MROPE,
    TEXT_DIMS,
    VISION_DIMS,
    portable_uniform,
    round_up,
    scale_output,
    seed_weights,
    silence_rows,
    special_ids,
)
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer
from omniflow.errors import ModelConfigError
from omniflow.hf_logging import quiet

REAL_OMNI = "Qwen/Qwen2.5-Omni-7B"
OMNI_SPEAKERS = ("Chelsie", "Ethan")
# The real talker's codec vocabulary: 8192 codes, then pad, bos, eos at 8292..8294 and
# mask at 8296; token2wav embeds the codes (and one more id: num_embeds is 8193).
_CODES = 8192
_CODEC_SPECIALS = {
    "tts_codec_pad_token_id": 8292,
    "tts_codec_start_token_id": 8293,
    "tts_codec_end_token_id": 8294,
    "tts_codec_mask_token_id": 8296,
}


def omni_config(tokenizer) -> tuple[Any, dict[str, int]]:
    """The tiny Qwen2_5OmniConfig and the speaker bos ids, from the omni tokenizer.

    Like the real checkpoint, the thinker's vocabulary extends past the tokenizer; the
    talker's text-side tokens (tts pad/bos/eos) and the speakers' bos tokens live there.
    """
    from transformers import Qwen2_5OmniConfig

    ids = special_ids(tokenizer)
    tail = iter(range(len(tokenizer), len(tokenizer) + 3 + len(OMNI_SPEAKERS)))
    tts_pad, tts_bos, tts_eos = next(tail), next(tail), next(tail)
    speaker_bos = {speaker: next(tail) for speaker in OMNI_SPEAKERS}
    vocab_size = round_up(len(tokenizer) + 3 + len(OMNI_SPEAKERS), 64)
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
            **TEXT_DIMS,
            "vocab_size": vocab_size,
            "rope_parameters": MROPE,
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
            "output_dim": TEXT_DIMS["hidden_size"],
        },
        "vision_config": {**VISION_DIMS, "out_hidden_size": TEXT_DIMS["hidden_size"]},
        "user_token_id": tokenizer.convert_tokens_to_ids("user"),
        **media,
    }
    # The real codec vocabulary is 8448 with pad, bos, eos at 8292..8294 and mask at 8296
    # after 8192 codes; here 160 with the same specials at 128..132 after 128 codes.
    talker = {
        "vocab_size": 160,
        "tts_codec_pad_token_id": CODEBOOK_SIZE,
        "tts_codec_start_token_id": CODEBOOK_SIZE + 1,
        "tts_codec_end_token_id": CODEBOOK_SIZE + 2,
        "tts_codec_mask_token_id": CODEBOOK_SIZE + 4,
        "tts_text_pad_token_id": tts_pad,
        "tts_text_start_token_id": tts_bos,
        "tts_text_end_token_id": tts_eos,
        # The talker reads thinker embeddings and hidden states: its input width is the
        # thinker's; its own decoder is narrower, as in the real 3584 -> 896.
        "embedding_size": TEXT_DIMS["hidden_size"],
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_parameters": MROPE,
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
            "num_embeds": CODEBOOK_SIZE,
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


def speaker_map(speaker_bos: dict[str, int], dit: Any) -> dict[str, dict[str, Any]]:
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


def save_processor_parts(
    out: Path, image_options: dict | None = None, video_defaults: dict | None = None
) -> None:
    """The processor's parts as the published checkpoint lays them out (the processor that
    bundles them needs torchvision): one `preprocessor_config.json` holding the audio front
    end (`WhisperFeatureExtractor`, 128 mel bins at 16 kHz) and the image processor
    (`Qwen2VLImageProcessor`, its published pixel bounds, or `image_options`), and the video
    processor's settings (`video_preprocessor_config.json`: `Qwen2VLVideoProcessor`, the
    processor's pixel bounds per frame, 2 frames a second, or `video_defaults`)."""
    import json
    import tempfile

    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from omniflow.families.qwen2_5_omni.towers import VIDEO_CONFIG, VIDEO_DEFAULTS

    if image_options is None:
        image_options = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16384}
    WhisperFeatureExtractor(feature_size=128, return_attention_mask=True).save_pretrained(out)
    file = out / "preprocessor_config.json"
    audio = json.loads(file.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        Qwen2VLImageProcessorPil(**image_options).save_pretrained(tmp)
        image = json.loads((Path(tmp) / "preprocessor_config.json").read_text(encoding="utf-8"))
    merged = {**image, **audio, "image_processor_type": "Qwen2VLImageProcessor"}
    file.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": image["patch_size"],
        "temporal_patch_size": image["temporal_patch_size"],
        "merge_size": image["merge_size"],
        "image_mean": image["image_mean"],
        "image_std": image["image_std"],
        **(VIDEO_DEFAULTS if video_defaults is None else video_defaults),
    }
    (out / VIDEO_CONFIG).write_text(
        json.dumps(video, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


def build_tiny(out: Path) -> Iterator[str]:
    from transformers import Qwen2_5OmniForConditionalGeneration

    yield "tokenizer"
    tokenizer = build_tokenizer("omni")
    tokenizer.save_pretrained(out)
    save_processor_parts(out)

    yield "model"
    config, speaker_bos = omni_config(tokenizer)
    model = Qwen2_5OmniForConditionalGeneration(config)

    yield "weights"
    for part in ("thinker", "talker", "token2wav"):
        seed_weights(getattr(model, part), f"qwen2.5-omni/{part}")
    model.eval()
    # conv_post's output std is 64 with these weights: 0.005 brings it to about 0.3.
    scale_output(model.token2wav.code2wav_bigvgan_model.conv_post, 0.005)
    silence_rows(model.thinker.lm_head.weight, len(tokenizer))
    # Like the real talker, emit only codes and the pad/bos/eos ids after them (bos is
    # suppressed by generate), never the mask or unused ids: token2wav embeds codes only.
    silence_rows(model.talker.codec_head.weight, config.talker_config.tts_codec_end_token_id + 1)

    yield "speakers"
    speakers = speaker_map(speaker_bos, config.token2wav_config.dit_config)
    # from_pretrained requires spk_dict.pt beside the weights.
    torch.save(speakers, out / "spk_dict.pt")

    yield "save"
    model.save_pretrained(out)


# --- the unsplit reference ---


class OmniReference(NamedTuple):
    """What `reference_omni_generate` returns.

    text_ids: the generated text tokens (prompt excluded), shape (n,), int64.
    text: text_ids decoded, special tokens skipped.
    codec_ids: the talker's codes that token2wav decoded (ends-of-speech excluded), (m,).
    waveform: token2wav's 24 kHz audio, shape (samples,), float32.
    """

    text_ids: torch.Tensor
    text: str
    codec_ids: torch.Tensor
    waveform: torch.Tensor


def omni_prompt_ids(tokenizer, prompt_text: str) -> torch.Tensor:
    """The (1, n) input ids of a one-turn chat with the omni model's default system prompt."""
    messages = [{"role": "user", "content": prompt_text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt").input_ids


@contextmanager
def watching_talker(model, keep: Callable[[dict, Any], None]) -> Iterator[None]:
    """Within: `model.talker.generate` (on this instance) hands its keyword arguments and
    its result to `keep` too, since an omni model's `generate` returns only text and audio
    and a reference wants what the talker generated."""
    talker_generate = model.talker.generate

    def recording_generate(*args, **kwargs):
        result = talker_generate(*args, **kwargs)
        keep(kwargs, result)
        return result

    model.talker.generate = recording_generate
    try:
        yield
    finally:
        del model.talker.generate


@torch.no_grad()
def reference_omni_generate(
    model_dir: str | Path,
    prompt_text: str | None,
    max_new_tokens: int = 16,
    *,
    speaker: str = "Chelsie",
    talker_max_new_tokens: int = 64,
    seed: int = 0,
    model=None,
    input_ids: torch.Tensor | None = None,
    **generate_kwargs,
) -> OmniReference:
    """Qwen2.5-Omni's own `generate`: thinker text, then talker codes, then token2wav audio.

    Runs `Qwen2_5OmniForConditionalGeneration.generate` with greedy thinker and talker
    decoding and otherwise the model's own defaults (the talker's repetition penalty of
    1.05 included); extra keyword arguments pass through (`talker_repetition_penalty=1.0`,
    `token2wav_num_steps=...`). Two settings are not the class's literal defaults: the
    talker's end-of-speech ids come from this checkpoint's config (the class hard-codes
    the real model's 8292/8294), and the global torch RNG is seeded with `seed` just
    before `generate` — greedy decoding draws nothing, so token2wav's initial noise is the
    first `torch.randn` after `torch.manual_seed(seed)`.

    `model`: the loaded model, else it loads from `model_dir`. `input_ids` (the
    processor's, its placeholders expanded) replace the prompt's own, and the processor's
    media inputs pass through as keyword arguments; its pixel values go to the thinker
    under `generate`'s own `thinker_` prefix, since without one `generate` passes them to
    the talker's `generate` too, which refuses them (ValueError in transformers 5.24).
    """
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if model is None:
            model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir).eval()
    talker_config = model.config.talker_config
    end_of_speech = [talker_config.tts_codec_pad_token_id, talker_config.tts_codec_end_token_id]
    if input_ids is None:
        input_ids = omni_prompt_ids(tokenizer, prompt_text)
    for key in ("pixel_values", "pixel_values_videos"):
        if key in generate_kwargs:
            generate_kwargs[f"thinker_{key}"] = generate_kwargs.pop(key)

    # generate() returns only text and audio; the codes it decodes are the talker's
    # output, so watch the talker's generate on this instance to keep them.
    talker_outputs = []

    def keep(kwargs, sequences):
        talker_outputs.append(sequences[:, kwargs["input_ids"].shape[1] :])

    torch.manual_seed(seed)
    with watching_talker(model, keep), quiet():
        sequences, waveform = model.generate(
            input_ids,
            speaker=speaker,
            thinker_max_new_tokens=max_new_tokens,
            thinker_do_sample=False,
            talker_max_new_tokens=talker_max_new_tokens,
            talker_do_sample=False,
            talker_eos_token_id=end_of_speech,
            **generate_kwargs,
        )
    text_ids = sequences[0, input_ids.shape[1] :]
    codes = talker_outputs[0][0]
    # The model decodes the codes before the first end-of-speech id, as here.
    ends = torch.isin(codes, torch.tensor(end_of_speech)).nonzero()
    codec_ids = codes[: int(ends[0]) if len(ends) else len(codes)]
    text = tokenizer.decode(text_ids, skip_special_tokens=True)
    return OmniReference(text_ids, text, codec_ids, waveform)


# --- real size ---


def scaled_omni_config(depth: float = 1.0) -> tuple[Any, dict[str, int], Any]:
    """(Qwen2_5OmniConfig, speaker bos ids, tokenizer) at real widths and `depth` x layers."""
    from transformers import Qwen2_5OmniConfig

    check_depth(depth)
    tokenizer = build_tokenizer("omni")
    with quiet():  # the tiny config's ids warn against its tiny vocabularies
        tiny, speaker_bos = omni_config(tokenizer)
    config = tiny.to_dict()
    real = builtin_files(REAL_OMNI)["config.json"]
    parts = {
        ("thinker_config", "text_config"): real["thinker_config"]["text_config"],
        ("thinker_config", "audio_config"): real["thinker_config"]["audio_config"],
        ("thinker_config", "vision_config"): real["thinker_config"]["vision_config"],
        ("talker_config",): real["talker_config"],
        ("token2wav_config", "dit_config"): real["token2wav_config"]["dit_config"],
        ("token2wav_config", "bigvgan_config"): real["token2wav_config"]["bigvgan_config"],
    }
    scale_into(config, parts, depth)
    config["talker_config"].update(_CODEC_SPECIALS)
    return Qwen2_5OmniConfig(**config), speaker_bos, tokenizer


def build_scaled_omni(out: str | Path, depth: float = 1.0, device: str = "cuda") -> Path:
    """Build and save a random-weight Qwen2.5-Omni at real widths; returns the directory."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    config, speaker_bos, tokenizer = scaled_omni_config(depth)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    save_processor_parts(out)  # the towers' stages load them (omni chat hears and sees)
    with initialising_bf16_on(device):
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
    silence_rows(model.thinker.lm_head.weight, len(tokenizer))
    silence_rows(model.talker.codec_head.weight, _CODES)
    with torch.no_grad():
        model.thinker.lm_head.weight[config.thinker_config.text_config.eos_token_id] = 0
    torch.save(speaker_map(speaker_bos, config.token2wav_config.dit_config), out / "spk_dict.pt")
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(out)
    return out


def scaled_token2wav(depth: float = 1.0, device: str = "cuda") -> Path:
    """A checkpoint of the scaled model's token2wav alone (its config, `spk_dict.pt`, the
    token2wav weights in bf16) under `$OMNIFLOW_CACHE/scaled/`, built on first use: what the
    token2wav decoder loads, without the ~20 GB of the whole model."""
    from transformers import Qwen2_5OmniToken2WavModel

    out = cache_root() / "scaled" / f"qwen2.5-omni-token2wav-{depth:g}"
    if (out / MANIFEST).exists():
        return out
    config, speaker_bos, _ = scaled_omni_config(depth)
    out.mkdir(parents=True, exist_ok=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with quiet(), torch.device(device):
            model = Qwen2_5OmniToken2WavModel(config.token2wav_config).eval()
    finally:
        torch.set_default_dtype(previous)
    with quiet():
        model.save_pretrained(out)
        config.save_pretrained(out)  # the whole model's config, which the decoder reads
    torch.save(speaker_map(speaker_bos, config.token2wav_config.dit_config), out / "spk_dict.pt")
    (out / MANIFEST).write_text(
        json.dumps({"model": REAL_OMNI, "depth": depth, "part": "token2wav"})
    )
    return out


def scaled_stage(part: str, depth: float = 1.0, device: str = "cuda"):
    """One AR stage of the scaled model as the transformers backend's `Component`, its
    random bf16 weights made in memory on `device` (no checkpoint is written): what a GPU
    test or `benchmarks/stage_steps.py` needs of the real-size model without ~20 GB on disk.

    "thinker": the real `OmniThinker` (text prompts, `hidden` items for the talker).
    "talker": the talker's decoder, head and input projection under `ScaledTalker`, which
    takes token-id prompts (embedded by the talker's own table) and adds a fixed text-side
    row to every step's input, as the real talker adds the thinker's row; it never ends
    before max_tokens. Its step is the real talker's; what it skips is receiving streamed
    conditioning."""
    from transformers import (
        Qwen2_5OmniTalkerForConditionalGeneration,
        Qwen2_5OmniThinkerForConditionalGeneration,
    )

    config, _, tokenizer = scaled_omni_config(depth)
    classes = {
        "thinker": (Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config),
        "talker": (Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config),
    }
    if part not in classes:
        raise ModelConfigError(f"no AR stage '{part}'; use thinker or talker")
    cls, part_config = classes[part]
    with initialising_bf16_on(device):
        model = cls(part_config).eval()
    if part == "thinker":
        silence_rows(model.lm_head.weight, len(tokenizer))
        with torch.no_grad():
            model.lm_head.weight[part_config.text_config.eos_token_id] = 0
        from omniflow.families.qwen2_5_omni.thinker_talker import OmniThinker

        return OmniThinker(model, tokenizer)
    silence_rows(model.codec_head.weight, _CODES)
    return _scaled_talker_class()(model)


@functools.cache
def _scaled_talker_class():
    from omniflow.backends.transformers_ar import Component, Prompt
    from omniflow.families.qwen2_5_omni.thinker_talker import talker_defaults

    class ScaledTalker(Component):
        """The talker's decode step on token-id prompts (see `scaled_stage`)."""

        inputs = {"prompt": ("tokens",)}
        required = frozenset({"prompt"})
        outputs = frozenset({"codes", "tokens", "hidden"})

        def __init__(self, model):
            config = model.config
            self.model = model
            self.decoder = model.model
            self.head = model.codec_head
            self.embed = model.get_input_embeddings()
            self.eos_ids = frozenset()
            self.suppress = (config.tts_codec_start_token_id,)
            self.defaults = talker_defaults()
            weight = self.embed.weight
            self.text_row = torch.randn(
                weight.shape[1], generator=torch.Generator().manual_seed(0)
            ).to(weight.device, weight.dtype)

        def project(self, embeds):
            return self.model.thinker_to_talker_proj(embeds)

        def can_start(self, call) -> bool:
            return call.inputs["prompt"].ended

        def prompt(self, call) -> Prompt:
            ids = torch.as_tensor(call.inputs["prompt"].take()).reshape(-1)
            return Prompt(self.embed(ids.to(self.embed.weight.device)), ids.tolist())

        def step_extra(self, seqs):
            return torch.stack([self.text_row for _ in seqs])

    return ScaledTalker


def __getattr__(name: str):
    if name == "ScaledTalker":  # defined on first use: it needs the backend's classes
        return _scaled_talker_class()
    raise AttributeError(name)

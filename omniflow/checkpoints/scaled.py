"""Real-size random-weight Qwen2.5-Omni checkpoints, for measuring on a GPU without weights.

`scaled_omni_config(depth)` is the published Qwen2.5-Omni-7B configuration (every width,
head count and vocabulary size of the builtin catalog's copy) on the tiny recipe's
tokenizer and special ids, with each stack's layer count multiplied by `depth` (1.0 = the
real model). `build_scaled_omni(out, depth, device)` initialises it on `device` in bf16
the way transformers initialises an untrained model, saves it with `save_pretrained`, and
the result loads through exactly the path a real checkpoint does; `MANIFEST`, written
last, marks a finished build. `scaled_checkpoint(depth)` builds one once into the cache.

`scaled_image_config(depth)` and `build_scaled_image` do the same for Qwen-Image (the
catalog's published text encoder, transformer and VAE configs; the text encoder's and the
transformer's layers x `depth`, the VAE whole) on the tiny qwen tokenizer, saved as a
diffusers pipeline folder that the diffusers backends load as they load the real one;
`scaled_checkpoint(depth, model=REAL_IMAGE)` caches one.

Random weights would end text and speech at random points, so the output heads' rows of
every id that ends or pads (and of ids the next stage cannot take) are zeroed: a request
then runs to its token limits, and every system measured on the checkpoint does the same
work.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from pathlib import Path
from typing import Any

import torch

from omniflow.checkpoints.tiny_recipes import (
    QWEN_IMAGE_SCHEDULER,
    _omni_config,
    _qwen_vl_config,
    _silence_rows,
    _speaker_map,
    build_tokenizer,
)
from omniflow.errors import ModelConfigError
from omniflow.hf_logging import quiet
from omniflow.models.catalog import builtin_files

REAL_OMNI = "Qwen/Qwen2.5-Omni-7B"
REAL_IMAGE = "Qwen/Qwen-Image"
# Written last: a directory without it is an interrupted build.
MANIFEST = "omniflow_scaled.json"
# The real talker's codec vocabulary: 8192 codes, then pad, bos, eos at 8292..8294 and
# mask at 8296; token2wav embeds the codes (and one more id: num_embeds is 8193).
_CODES = 8192
_CODEC_SPECIALS = {
    "tts_codec_pad_token_id": 8292,
    "tts_codec_start_token_id": 8293,
    "tts_codec_end_token_id": 8294,
    "tts_codec_mask_token_id": 8296,
}
# Multimodal RoPE of a 128-dim head: 64 frequency pairs over (time, height, width).
_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "embedding_size",
    "d_model",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "output_dim",
    "num_heads",
    "out_hidden_size",
    "ff_mult",
    "emb_dim",
    "num_embeds",
    "upsample_initial_channel",
    "resblock_kernel_sizes",
    "resblock_dilation_sizes",
    "upsample_rates",
    "upsample_kernel_sizes",
)
# Set by the tiny recipe, left at the class defaults by the real config: the speaker encoder.
_DEFAULTED = (
    "enc_emb_dim",
    "enc_dim",
    "enc_channels",
    "enc_attention_channels",
    "enc_se_channels",
)
_DEPTHS = ("num_hidden_layers", "encoder_layers", "depth")
# Layer indexes that must stay inside a scaled stack.
_INDEXES = ("fullatt_block_indexes", "look_ahead_layers", "look_backward_layers")


def scaled_omni_config(depth: float = 1.0) -> tuple[Any, dict[str, int], Any]:
    """(Qwen2_5OmniConfig, speaker bos ids, tokenizer) at real widths and `depth` x layers."""
    from transformers import Qwen2_5OmniConfig

    _check_depth(depth)
    tokenizer = build_tokenizer("omni")
    with quiet():  # the tiny config's ids warn against its tiny vocabularies
        tiny, speaker_bos = _omni_config(tokenizer)
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
    _scale_into(config, parts, depth)
    config["talker_config"].update(_CODEC_SPECIALS)
    return Qwen2_5OmniConfig(**config), speaker_bos, tokenizer


def _check_depth(depth: float) -> None:
    if not 0 < depth <= 1:
        raise ModelConfigError(f"depth must be in (0, 1], not {depth}")


def _layers(real: int, depth: float) -> int:
    return max(1, round(real * depth))


def _scale_into(config: dict[str, Any], parts: dict[tuple[str, ...], dict], depth: float) -> None:
    """Give the sub-configs of a tiny recipe's `config` (a config's `to_dict()`) at each
    key path of `parts` the real config's widths and `depth` x its layers."""
    for path, source in parts.items():
        target = config
        for key in path:
            target = target[key]
        target.update(_scaled(source, depth))
        target.pop("layer_types", None)  # derived from the layer count again
        for key in _DEFAULTED:
            target.pop(key, None)
        if "rope_parameters" in target and "mrope_section" in target["rope_parameters"]:
            target["rope_parameters"] = dict(_MROPE)
    config.pop("transformers_version", None)


def _scaled(source: dict[str, Any], depth: float) -> dict[str, Any]:
    out = {key: copy.deepcopy(source[key]) for key in _SIZES if key in source}
    for key in _DEPTHS:
        if key in source:
            out[key] = _layers(source[key], depth)
            layers, real_layers = out[key], source[key]
    for key in _INDEXES:
        if key in source:
            out[key] = sorted(
                {min(layers - 1, round(i * layers / real_layers)) for i in source[key]}
            )
    return out


def build_scaled_omni(out: str | Path, depth: float = 1.0, device: str = "cuda") -> Path:
    """Build and save a random-weight Qwen2.5-Omni at real widths; returns the directory."""
    from transformers import Qwen2_5OmniForConditionalGeneration, WhisperFeatureExtractor

    config, speaker_bos, tokenizer = scaled_omni_config(depth)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=128, return_attention_mask=True).save_pretrained(out)
    with _initialising_bf16_on(device):
        model = Qwen2_5OmniForConditionalGeneration(config).eval()
    _silence_rows(model.thinker.lm_head.weight, len(tokenizer))
    _silence_rows(model.talker.codec_head.weight, _CODES)
    with torch.no_grad():
        model.thinker.lm_head.weight[config.thinker_config.text_config.eos_token_id] = 0
    torch.save(_speaker_map(speaker_bos, config.token2wav_config.dit_config), out / "spk_dict.pt")
    model.config.torch_dtype = torch.bfloat16
    model.save_pretrained(out)
    (out / MANIFEST).write_text(json.dumps({"model": REAL_OMNI, "depth": depth}))
    return out


def scaled_checkpoint(depth: float, device: str = "cuda", model: str = REAL_OMNI) -> Path:
    """The scaled checkpoint of `model` (REAL_OMNI or REAL_IMAGE) at `depth` under
    `$OMNIFLOW_CACHE/scaled/`, built on first use."""
    from omniflow.checkpoints.tiny import tiny_cache_dir

    builders = {
        REAL_OMNI: ("qwen2.5-omni", build_scaled_omni),
        REAL_IMAGE: ("qwen-image", build_scaled_image),
    }
    if model not in builders:
        raise ModelConfigError(f"no scaled build of '{model}'; there are {', '.join(builders)}")
    name, build = builders[model]
    out = tiny_cache_dir().parent / "scaled" / f"{name}-{depth:g}"
    if not (out / MANIFEST).exists():
        print(f"building {out} ...", flush=True)
        build(out, depth, device)
    return out


def scaled_image_config(
    depth: float = 1.0, files: dict[str, dict] | None = None
) -> tuple[Any, dict[str, Any], dict[str, Any], Any]:
    """(text encoder Qwen2_5_VLConfig, transformer config, VAE config, tokenizer) of
    Qwen-Image at real widths, the text encoder's and the transformer's layers x `depth`.
    `files`: the published config files to take the widths from (default: the catalog's)."""
    from transformers import Qwen2_5_VLConfig

    _check_depth(depth)
    tokenizer = build_tokenizer("qwen")
    real = files or builtin_files(REAL_IMAGE)
    with quiet():  # the tiny config's ids warn against its tiny vocabulary
        config = _qwen_vl_config(tokenizer).to_dict()
    text = real["text_encoder/config.json"]  # the published flat Qwen2.5-VL-7B layout
    _scale_into(config, {("text_config",): text, ("vision_config",): text["vision_config"]}, depth)
    transformer, vae = (
        {k: v for k, v in real[f"{part}/config.json"].items() if not k.startswith("_")}
        for part in ("transformer", "vae")
    )
    transformer["num_layers"] = _layers(transformer["num_layers"], depth)
    return Qwen2_5_VLConfig(**config), transformer, vae, tokenizer


def build_scaled_image(
    out: str | Path, depth: float = 1.0, device: str = "cuda", files: dict[str, dict] | None = None
) -> Path:
    """Build and save a random-weight Qwen-Image pipeline at real widths (a diffusers
    pipeline folder, what the diffusers backends load); returns the directory. `files` as
    for `scaled_image_config`."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration

    text, transformer, vae, tokenizer = scaled_image_config(depth, files)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    with _initialising_bf16_on(device):
        pipeline = QwenImagePipeline(
            scheduler=scheduler,
            vae=AutoencoderKLQwenImage(**vae),
            text_encoder=Qwen2_5_VLForConditionalGeneration(text).eval(),
            tokenizer=tokenizer,
            transformer=QwenImageTransformer2DModel(**transformer),
        )
    out = Path(out)
    with quiet():
        pipeline.save_pretrained(out)
    (out / MANIFEST).write_text(json.dumps({"model": REAL_IMAGE, "depth": depth}))
    return out


def scaled_token2wav(depth: float = 1.0, device: str = "cuda") -> Path:
    """A checkpoint of the scaled model's token2wav alone (its config, `spk_dict.pt`, the
    token2wav weights in bf16) under `$OMNIFLOW_CACHE/scaled/`, built on first use: what the
    token2wav decoder loads, without the ~20 GB of the whole model."""
    from transformers import Qwen2_5OmniToken2WavModel

    from omniflow.checkpoints.tiny import tiny_cache_dir

    out = tiny_cache_dir().parent / "scaled" / f"qwen2.5-omni-token2wav-{depth:g}"
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
    torch.save(_speaker_map(speaker_bos, config.token2wav_config.dit_config), out / "spk_dict.pt")
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

    from omniflow.backends.models.qwen_omni import OmniThinker

    config, _, tokenizer = scaled_omni_config(depth)
    classes = {
        "thinker": (Qwen2_5OmniThinkerForConditionalGeneration, config.thinker_config),
        "talker": (Qwen2_5OmniTalkerForConditionalGeneration, config.talker_config),
    }
    if part not in classes:
        raise ModelConfigError(f"no AR stage '{part}'; use thinker or talker")
    cls, part_config = classes[part]
    with _initialising_bf16_on(device):
        model = cls(part_config).eval()
    if part == "thinker":
        _silence_rows(model.lm_head.weight, len(tokenizer))
        with torch.no_grad():
            model.lm_head.weight[part_config.text_config.eos_token_id] = 0
        return OmniThinker(model, tokenizer)
    _silence_rows(model.codec_head.weight, _CODES)
    return _scaled_talker_class()(model)


@functools.cache
def _scaled_talker_class():
    from omniflow.backends.models.qwen_omni import _talker_defaults
    from omniflow.backends.transformers_ar import Component, Prompt

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
            self.defaults = _talker_defaults()
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


@contextlib.contextmanager
def _initialising_bf16_on(device: str):
    """Modules built inside are initialised in bf16 straight on `device` (a real-size model
    in fp32 on the host first would take twice its memory and minutes), quietly."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with quiet(), torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)

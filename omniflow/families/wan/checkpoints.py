"""Wan2.2's checkpoints: tiny pipelines of the real architectures, and the real-size
random-weight builds.

- `build_t2v` (`tiny:wan2.2-t2v`): `WanPipeline` as Wan2.2-T2V-A14B is laid out: a UMT5
  text encoder, two `WanTransformer3DModel` experts (`boundary_ratio` 0.875), the Wan2.1
  `AutoencoderKLWan` (the published latent statistics) and the published UniPC scheduler;
  `build_i2v` (`tiny:wan2.2-i2v`): `WanImageToVideoPipeline` as Wan2.2-I2V-A14B, experts
  on 36 channels, `boundary_ratio` 0.9, no image encoder; `build_ti2v` (`tiny:wan2.2-ti2v`):
  `WanPipeline` as Wan2.2-TI2V-5B, one expert on 48 channels, `expand_timesteps`, the
  Wan2.2 VAE (residual, 2x2 patchified input, 16x spatial scale, its published latent
  statistics). The tokenizer is a tiny T5 Unigram tokenizer (`build_t5_tokenizer`). The
  references are the diffusers pipelines' own `__call__`.
- `build_scaled_t2v`, `_i2v`, `_ti2v` (`scaled_checkpoint(model, depth)`): the catalog's
  published configs, every expert's and the text encoder's layers x `depth`, random bf16
  weights made on the device, saved as a diffusers pipeline folder. Wan2.2-A14B at depth 1
  is 2 x 14.3 B + 5.7 B parameters, 69 GB in bf16: more than the GPU host's 64 GiB disk,
  so measure it at depth 0.5 (20 of 40 layers, 40 GB) or less; a DiT step's per-layer
  work, and so its ratio to the FLOP roofline, does not depend on the depth.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omniflow.catalog.components import builtin_files
from omniflow.checkpoints.scaled import check_depth, initialising_bf16_on, scaled_layers
from omniflow.checkpoints.tiny_recipes import seed_weights
from omniflow.checkpoints.tiny_tokenizer import build_t5_tokenizer
from omniflow.hf_logging import quiet

REAL_T2V = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
REAL_I2V = "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
REAL_TI2V = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
# The published UniPC scheduler (diffusers' convert_wan_to_diffusers.py): flow_shift 3.0 for
# the A14B checkpoints, 5.0 for TI2V-5B.
_SCHEDULER = {
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "num_train_timesteps": 1000,
}

# Tiny dims. The text encoder: UMT5 (gated-GELU T5 v1.1 layers, a relative-position bias in
# every layer), 32 wide. The DiT: 2 layers of 2 heads of 16 dims (RoPE splits a head's dims
# into frames 8, height 4, width 4, as 128 splits into 44, 42, 42), the real patch (1, 2, 2),
# timestep frequencies (256) and rotary length (1024). The VAEs: the real structure at base
# width 8 (the Wan2.2 decoder's 16), one res block a level.
_TEXT = {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4}
_DIT = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "text_dim": _TEXT["d_model"],
    "freq_dim": 256,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
}
_VAE21 = {"base_dim": 8, "num_res_blocks": 1}  # z 16 and the Wan2.1 statistics: the defaults
_VAE22 = {"base_dim": 8, "decoder_base_dim": 16, "num_res_blocks": 1}


def _umt5_config(tokenizer, **dims):
    from transformers import UMT5Config

    return UMT5Config(
        vocab_size=len(tokenizer),
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **dims,
    )


def _published(model: str, part: str) -> dict[str, Any]:
    """A part's published config (the catalog's), without diffusers' bookkeeping keys."""
    config = builtin_files(model)[f"{part}/config.json"]
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _build(out: Path, real: str, recipe: str, in_channels: int, two: bool) -> Iterator[str]:
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5EncoderModel

    index = builtin_files(real)["model_index.json"]
    ti2v = bool(index.get("expand_timesteps"))
    yield "tokenizer"
    tokenizer = build_t5_tokenizer()
    yield "text_encoder"
    text_encoder = seed_weights(
        UMT5EncoderModel(_umt5_config(tokenizer, **_TEXT)), f"{recipe}/text_encoder"
    )
    vae_config = _published(real, "vae")
    out_channels = vae_config["z_dim"]
    experts = []
    for part in ("transformer", "transformer_2") if two else ("transformer",):
        yield part
        dit = WanTransformer3DModel(**_DIT, in_channels=in_channels, out_channels=out_channels)
        experts.append(seed_weights(dit, f"{recipe}/{part}"))
    yield "vae"
    tiny_vae = _VAE22 if ti2v else _VAE21
    vae = seed_weights(AutoencoderKLWan(**{**vae_config, **tiny_vae}), f"{recipe}/vae")
    yield "save"
    shift = builtin_files(real)["scheduler/scheduler_config.json"]["flow_shift"]
    cls = (
        WanImageToVideoPipeline
        if index["_class_name"] == "WanImageToVideoPipeline"
        else WanPipeline
    )
    pipeline = cls(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**_SCHEDULER, flow_shift=shift),
        transformer=experts[0],
        transformer_2=experts[1] if two else None,
        boundary_ratio=index.get("boundary_ratio"),
        expand_timesteps=ti2v,
    )
    with quiet():
        pipeline.save_pretrained(out)


def build_t2v(out: Path) -> Iterator[str]:
    yield from _build(out, REAL_T2V, "wan2.2-t2v", 16, two=True)


def build_i2v(out: Path) -> Iterator[str]:
    # 16 noise channels, the 4-channel first-frame mask, the image's 16 latent channels.
    yield from _build(out, REAL_I2V, "wan2.2-i2v", 36, two=True)


def build_ti2v(out: Path) -> Iterator[str]:
    yield from _build(out, REAL_TI2V, "wan2.2-ti2v", 48, two=False)


# --- real size ---


def scaled_configs(model: str, depth: float = 1.0) -> dict[str, Any]:
    """The published configs of `model` (the catalog's) with every expert's and the text
    encoder's layers x `depth`: {"text_encoder": UMT5Config, "transformer": {...},
    "transformer_2": {...} or None, "vae": {...}, "index": model_index, "scheduler": {...}}."""
    from transformers import UMT5Config

    check_depth(depth)
    files = builtin_files(model)
    text = {k: v for k, v in files["text_encoder/config.json"].items() if k != "architectures"}
    text["num_layers"] = scaled_layers(text["num_layers"], depth)
    text.pop("torch_dtype", None)
    experts = {}
    for part in ("transformer", "transformer_2"):
        if f"{part}/config.json" in files:
            config = _published(model, part)
            config["num_layers"] = scaled_layers(config["num_layers"], depth)
            experts[part] = config
    scheduler = {
        k: v for k, v in files["scheduler/scheduler_config.json"].items() if not k.startswith("_")
    }
    return {
        "text_encoder": UMT5Config(**text),
        "transformer": experts["transformer"],
        "transformer_2": experts.get("transformer_2"),
        "vae": _published(model, "vae"),
        "index": files["model_index.json"],
        "scheduler": scheduler,
    }


def build_scaled(model: str, out: str | Path, depth: float = 1.0, device: str = "cuda") -> Path:
    """Build and save a random-weight Wan2.2 pipeline at real widths (a diffusers pipeline
    folder, what the diffusers backends load), on the tiny T5 tokenizer; returns the folder.

    Random weights are made in bf16 on `device` as diffusers and transformers initialise an
    untrained model; each expert is saved and freed before the next is made, so the device
    holds one expert at a time."""
    import torch
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5EncoderModel

    configs = scaled_configs(model, depth)
    index = configs["index"]
    out = Path(out)
    parts = {}
    with initialising_bf16_on(device):
        for part in ("transformer", "transformer_2"):
            if configs[part] is None:
                continue
            expert = WanTransformer3DModel(**configs[part])
            with quiet():
                expert.save_pretrained(out / part)
            del expert
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
            parts[part] = True
        text_encoder = UMT5EncoderModel(configs["text_encoder"]).eval()
        vae = AutoencoderKLWan(**configs["vae"])
    cls = (
        WanImageToVideoPipeline
        if index["_class_name"] == "WanImageToVideoPipeline"
        else WanPipeline
    )
    pipeline = cls(
        tokenizer=build_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=UniPCMultistepScheduler(**configs["scheduler"]),
        transformer=None,
        transformer_2=None,
        boundary_ratio=index.get("boundary_ratio"),
        expand_timesteps=bool(index.get("expand_timesteps")),
    )
    with quiet():
        pipeline.save_pretrained(out)
    _link_experts(out, parts)
    return out


def _link_experts(out: Path, parts: dict) -> None:
    """The experts, saved before the pipeline (which was built without them), back in its
    index."""
    import json

    index_file = out / "model_index.json"
    index = json.loads(index_file.read_text(encoding="utf-8"))
    for part in parts:
        index[part] = ["diffusers", "WanTransformer3DModel"]
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_scaled_t2v(out: str | Path, depth: float = 1.0, device: str = "cuda") -> Path:
    return build_scaled(REAL_T2V, out, depth, device)


def build_scaled_i2v(out: str | Path, depth: float = 1.0, device: str = "cuda") -> Path:
    return build_scaled(REAL_I2V, out, depth, device)


def build_scaled_ti2v(out: str | Path, depth: float = 1.0, device: str = "cuda") -> Path:
    return build_scaled(REAL_TI2V, out, depth, device)

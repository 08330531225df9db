"""Where a stage's model configuration comes from: never the network.

`load_component_config(model, component)` finds the configuration of one component of a
model (the thinker of an omni model, the VAE of a diffusion pipeline, a plain LM) and
returns a `ComponentConfig`: its category (what the compiler sizes it as), a flat HF-style
config dict, a dtype and where it came from. Resolution order:

1. `model` is a local directory: its `config.json` (transformers; a multi-part model's
   component is picked out of it by name) or `model_index.json` + `<component>/config.json`
   (diffusers pipelines, and multi-part speech models such as tiny:tts).
2. The local Hugging Face hub cache (`HF_HUB_CACHE`, `HF_HOME/hub` or
   `~/.cache/huggingface/hub`): `models--org--name/snapshots/<rev>/`, read as in 1.
3. The builtin catalog, one JSON file per model in each model family's `configs/` folder
   (`omniflow.families.published_configs`, package data): the
   model's published config files, reduced to the keys that decide shapes and sizes and
   keyed by their path in the model repository (`files`), as copied from the Hugging Face
   Hub; the parameter counts no formula in `omniflow.catalog.costs` covers
   (`parameter_counts`, by component); facts a component's config does not state but shape
   and cost estimates need (`facts`); and where each number comes from (`about`, `notes`).
   tests/catalog re-derives every count that an installed class can reproduce.

Both directory sources also count parameters that no architecture formula covers (vision
and audio towers, vocoders, projections) from the checkpoint's safetensors headers, without
loading a weight; the builtin catalog carries those counts instead.

How a multi-part checkpoint's components sit in its config files, and what a pipeline's own
code decides, are its model family's (`omniflow.families`: a family's `parts` and
`pipeline_facts`), looked up by the architecture the checkpoint declares. What a
component's config says comes first; the catalog's facts, and the family's defaults (e.g.
token2wav's 24 kHz, which its config does not state; the size of the image an edit
pipeline conditions on), fill in only what it leaves out.
"""

from __future__ import annotations

import copy
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow import families
from omniflow.catalog.resolve import TINY_SCHEME, model_path
from omniflow.dtypes import STAGE_DTYPES, canonical_dtype
from omniflow.errors import ModelConfigError, UnknownComponent
from omniflow.families import Part
from omniflow.hints import did_you_mean

CATEGORIES = (
    "decoder_lm",
    "moe_lm",
    "vision_encoder",
    "audio_encoder",
    "text_encoder",
    "dit",
    "vae",
    "vocoder",
)
LM_CATEGORIES = ("decoder_lm", "moe_lm", "text_encoder")
BUILTIN_SOURCE = "builtin catalog"


@dataclass(frozen=True)
class ComponentConfig:
    """One component of a model, as the compiler's shape and cost passes see it.

    `config` holds HF-style keys (hidden_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, head_dim, intermediate_size, vocab_size, tie_word_embeddings,
    num_experts, num_experts_per_tok, moe_intermediate_size, ...; diffusers keys for DiT and
    VAE). Two keys are omniflow's own: `num_parameters` (the component's parameter count,
    where no formula covers it) and `extra_parameters` (name -> count of modules that ride
    along with an LM component but are not its decoder, e.g. a thinker's audio tower).
    `architectures` are what the checkpoint declares, outermost first (a `model_index.json`'s
    `_class_name`, then the part's own `model_type`): the keys of the model families that
    know it. `part` is how its family says the component sits in it (None for a
    single-part checkpoint).
    """

    model: str
    component: str | None
    category: str
    config: dict[str, Any] = field(hash=False)
    dtype: str = "bfloat16"
    source: str = BUILTIN_SOURCE
    architectures: tuple[str, ...] = ()
    part: Part | None = field(default=None, compare=False, repr=False)

    @property
    def hidden_size(self) -> int | None:
        """Width of the hidden states the component emits (None for VAEs and vocoders).

        LMs and text encoders: hidden_size; vision encoders: the merger's out_hidden_size;
        audio encoders: output_dim; DiTs: the transformer's inner width. A part whose family
        says otherwise (`Part.hidden_width`: a tower that sends more beside its embeddings),
        what it says.
        """
        c = self.config
        if self.part is not None and self.part.hidden_width is not None:
            return self.part.hidden_width(c)
        if self.category in LM_CATEGORIES:
            return c["hidden_size"]
        if self.category == "vision_encoder":
            return c.get("out_hidden_size") or c.get("hidden_size")
        if self.category == "audio_encoder":
            return c.get("output_dim") or c.get("d_model")
        if self.category == "dit":
            return c["num_attention_heads"] * c["attention_head_dim"]
        return None

    @property
    def vocab_size(self) -> int | None:
        """Output vocabulary of an LM (a codec LM's codebook vocabulary); None otherwise."""
        return self.config.get("vocab_size") if self.category in LM_CATEGORIES else None

    @property
    def num_code_groups(self) -> int | None:
        """Codebooks per codec frame: emitted by a codec LM, consumed by a vocoder."""
        return self.config.get("num_code_groups") or self.config.get("num_quantizers")

    @property
    def num_codebooks(self) -> int | None:
        """Alias of `num_code_groups`."""
        return self.num_code_groups

    @property
    def sample_rate(self) -> int | None:
        """Output audio sample rate of a vocoder."""
        if self.category != "vocoder":
            return None
        c = self.config
        return c.get("output_sample_rate") or c.get("sample_rate") or c.get("sampling_rate")

    @property
    def samples_per_frame(self) -> int | None:
        """Audio samples a vocoder emits per codec frame (its total upsampling)."""
        if self.category != "vocoder":
            return None
        if self.part is not None and self.part.samples_per_frame is not None:
            return self.part.samples_per_frame(self.config)
        return samples_per_frame(self.config)

    @property
    def block_grid(self) -> tuple[int, int] | None:
        """(codes per block, codes of lookahead) of a vocoder that decodes on a grid of
        blocks (its family's part says), or None for a frame-local codec."""
        if self.part is None or self.part.block_grid is None:
            return None
        return self.part.block_grid(self.config)

    @property
    def added_positions(self) -> int:
        """Positions an LM's prompt may hold beyond the `max_len` prompt it is built from
        (its family's part says: a talker's rows after its thinker's prompt)."""
        return self.part.added_positions if self.part is not None else 0

    @property
    def carries_state(self) -> bool:
        """Whether a vocoder decodes causally, carrying each stream's state from one window
        to the next (its family's part says): it re-decodes no left context."""
        return self.category == "vocoder" and self.part is not None and self.part.carries_state

    @property
    def frame_rate(self) -> float | None:
        """Codec frames per second of audio (sample_rate / samples_per_frame)."""
        rate, per_frame = self.sample_rate, self.samples_per_frame
        return rate / per_frame if rate and per_frame else None

    @property
    def latent_channels(self) -> int | None:
        """Channels of the (unpacked) latent a DiT denoises and a VAE decodes."""
        c = self.config
        if self.category == "dit":
            return c.get("out_channels") or c["in_channels"] // c.get("patch_size", 1) ** 2
        if self.category == "vae":
            return c.get("z_dim") or c.get("latent_channels")
        return None

    @property
    def vae_scale_factor(self) -> int | None:
        """Pixels per latent position along each side (a DiT's comes from its pipeline's VAE)."""
        if self.category == "vae":
            return vae_scale_factor(self.config)
        return self.config.get("vae_scale_factor") if self.category == "dit" else None

    @property
    def vae_temporal_factor(self) -> int:
        """Video frames per latent frame after the first (1 for an image VAE; a DiT's comes
        from its pipeline's VAE)."""
        if self.category == "vae":
            return vae_temporal_factor(self.config)
        return self.config.get("vae_scale_factor_temporal") or 1 if self.category == "dit" else 1

    @property
    def patch_size(self) -> int | None:
        """Latent positions per DiT token along each side, or a ViT's pixel patch size (a
        video DiT's `[frames, height, width]` patch: its side)."""
        patch = self.config.get("patch_size")
        return patch[-1] if isinstance(patch, (list, tuple)) else patch

    @property
    def temporal_patch(self) -> int:
        """Latent frames per DiT token (1 but for a video DiT whose patch spans frames)."""
        patch = self.config.get("patch_size")
        return patch[0] if isinstance(patch, (list, tuple)) else 1

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a video asked for with `frames` frames (1 for an image): those
        of the frames it is made with (`video_frames`)."""
        t = self.vae_temporal_factor
        return (video_frames(frames, t) - 1) // t + 1

    def image_tokens(self, height: int, width: int, frames: int = 1) -> int:
        """Image tokens a DiT processes for one height x width image, or for each of a
        video's latent frames, all of them (`frames` video frames)."""
        side = self.vae_scale_factor * self.patch_size
        per_frame = (height // side) * (width // side)
        return per_frame * -(-self.latent_frames(frames) // self.temporal_patch)


def samples_per_frame(config: Mapping[str, Any]) -> int | None:
    """Total upsampling of a vocoder config, in the layouts transformers' codecs use."""
    if config.get("samples_per_frame"):
        return config["samples_per_frame"]
    if config.get("decode_upsample_rate"):
        return config["decode_upsample_rate"]
    if "upsample_rates" in config:
        return math.prod(config["upsample_rates"]) * math.prod(config.get("upsampling_ratios", ()))
    return None


# A block-grid vocoder decodes windows of these many blocks, the last repeating: one block
# first, for an early first packet, then wider windows, which re-decode their context and
# lookahead less often (a one-block token2wav window decodes 60 codes to keep 12; a
# sixteen-block one 240 to keep 192). On an H200 a token2wav window's replay grows far
# slower than its length (113 ms at 36 codes, 221 ms at 240), so its cost per kept code
# falls from 2.8 ms at four blocks to 1.2 ms at sixteen (docs/benchmarks-log.md, "Wider
# token2wav windows").
# Each window's codes and decode must come while the audio before it plays; each length is
# a set of static windows captured at load (cold start), so the ramp jumps from four blocks
# to sixteen rather than passing eight.
WINDOW_BLOCKS = (1, 2, 4, 16)


def vocoder_windows(
    vocoder: ComponentConfig, lookahead: int | None = None
) -> tuple[list[int], list[int]] | None:
    """For a block-grid vocoder, (codes each window keeps, codes that must arrive before each
    window can decode), the last of each repeating; None for a frame-local codec. `lookahead`
    (codes) replaces the grid's own."""
    grid = vocoder.block_grid
    if grid is None:
        return None
    unit, reach = grid
    lookahead = reach if lookahead is None else lookahead
    kept = [unit * blocks for blocks in WINDOW_BLOCKS]
    return kept, [kept[0] + lookahead, *kept[1:]]


def vae_scale_factor(config: Mapping[str, Any]) -> int | None:
    """Spatial downsampling of a VAE config (diffusers AutoencoderKL, AutoencoderKLQwenImage,
    AutoencoderKLWan, whose Wan2.2 form patchifies on top of its downsampling and says so)."""
    if "scale_factor_spatial" in config:
        return config["scale_factor_spatial"]
    if "temperal_downsample" in config:
        return 2 ** len(config["temperal_downsample"])
    if "block_out_channels" in config:
        return 2 ** (len(config["block_out_channels"]) - 1)
    return None


def vae_temporal_factor(config: Mapping[str, Any]) -> int:
    """Temporal downsampling of a VAE config: video frames per latent frame after the first
    (1 for an image VAE)."""
    if "scale_factor_temporal" in config:
        return config["scale_factor_temporal"]
    return 2 ** sum(bool(t) for t in config.get("temperal_downsample", ()))


def video_frames(frames: int, t: int) -> int:
    """The frames a video asked for with `frames` is made with, its VAE compressing `t`
    frames into each latent frame after the first: diffusers' video pipelines make
    `frames // t * t + 1` of a count that is not one more than a multiple of `t` already
    (80 make 81, 82 make 81), and what the compiler sizes, the denoiser makes and the
    server reports must be the same. No VAE compression (`t` 1): every frame asked."""
    frames = max(frames, 1)
    return frames // t * t + 1 if t > 1 else frames


def known_models() -> list[str]:
    """Model ids the builtin catalog knows, sorted."""
    return sorted(families.published_configs())


def builtin_files(model: str) -> dict[str, dict[str, Any]]:
    """A copy of the config files the builtin catalog holds for `model`, keyed by repo path."""
    name = _builtin_name(model)
    if name is None:
        raise ModelConfigError(
            _hinted(f"'{model}' is not in the builtin catalog", model, known_models())
        )
    return copy.deepcopy(families.published_configs()[name]["files"])


def load_component_config(model: str, component: str | None = None) -> ComponentConfig:
    """Find `component` of `model` in a local directory, the HF cache or the builtin catalog.

    `component` None means the whole model and is only valid for single-part models. Model
    ids are matched case-insensitively. Raises ModelConfigError naming the known models or
    the model's components (with a did-you-mean) when nothing matches.
    """
    model = model.strip().rstrip("/")
    if model.startswith(TINY_SCHEME):
        return _load(
            model, component, _DirFiles(Path(model_path(model))), f"tiny: {model_path(model)}"
        )
    path = Path(model).expanduser()
    if path.is_dir():
        return _load(str(path), component, _DirFiles(path), f"local: {path}")
    builtin = _builtin_name(model)
    snapshot = cached_snapshot(model)
    if snapshot is not None:
        name, root = snapshot
        fallback = _BuiltinFiles(builtin) if builtin else None
        return _load(name, component, _DirFiles(root, fallback), f"hf-cache: {root}")
    if builtin is not None:
        return _load(builtin, component, _BuiltinFiles(builtin), BUILTIN_SOURCE)
    raise ModelConfigError(
        _hinted(
            f"unknown model '{model}': not a local directory, not in the Hugging Face cache "
            f"({hub_cache_dir()}), not in the builtin catalog (known: {', '.join(known_models())})",
            model,
            known_models(),
        )
    )


# --- where files come from ---------------------------------------------------------------


class _DirFiles:
    """A model directory (local or an HF cache snapshot): json files and checkpoint counts."""

    def __init__(self, root: Path, fallback: _BuiltinFiles | None = None):
        self.root = root
        self.fallback = fallback

    def json(self, rel: str) -> dict[str, Any] | None:
        path = self.root / rel
        if not path.is_file():
            return None
        with path.open(encoding="utf-8") as f:
            return json.load(f)

    def count(self, component: str | None, name: str, rel_dir: str, prefixes: tuple[str, ...]):
        counted = count_checkpoint_parameters(self.root / rel_dir, prefixes)
        if counted is None and self.fallback is not None:
            return self.fallback.count(component, name, rel_dir, prefixes)
        return counted


class _BuiltinFiles:
    """The builtin catalog's copy of a model's config files and its parameter counts."""

    def __init__(self, model: str):
        self.model = model

    def json(self, rel: str) -> dict[str, Any] | None:
        # A copy: callers own the ComponentConfig.config they get back.
        return copy.deepcopy(families.published_configs()[self.model]["files"].get(rel))

    def count(self, component: str | None, name: str, rel_dir: str, prefixes: tuple[str, ...]):
        return _builtin_counts(self.model, component).get(name)


_Files = _DirFiles | _BuiltinFiles


def count_checkpoint_parameters(directory: Path, prefixes: tuple[str, ...] = ("",)) -> int | None:
    """Parameters in the safetensors files of `directory` whose names start with a prefix.

    Reads only each file's JSON header. None when the directory holds no safetensors file.
    When a `*.safetensors.index.json` is present only the files its weight_map names count,
    so stray duplicate checkpoints are not counted twice.
    """
    if not directory.is_dir():
        return None
    indexed = set()
    for index in directory.glob("*.safetensors.index.json"):
        indexed |= set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    files = [directory / f for f in sorted(indexed)] or sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total += sum(
            math.prod(info["shape"])
            for name, info in header.items()
            if name != "__metadata__" and name.startswith(prefixes)
        )
    return total


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory, as huggingface_hub resolves it."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface" / "hub"


def cached_snapshot(model: str) -> tuple[str, Path] | None:
    """(canonical id, snapshot dir) of `model` in the hub cache, matched case-insensitively."""
    cache = hub_cache_dir()
    if not cache.is_dir():
        return None
    wanted = "models--" + model.replace("/", "--").lower()
    repo = next((d for d in cache.iterdir() if d.name.lower() == wanted), None)
    if repo is None:
        return None
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    pinned = snapshots / ref.read_text().strip() if ref.is_file() else None
    if pinned is not None and _has_config(pinned):
        chosen = pinned
    else:
        # Without refs/main (a hand-made cache), the most recently written snapshot is current.
        candidates = [s for s in snapshots.glob("*") if _has_config(s)]
        if not candidates:
            return None
        chosen = max(candidates, key=lambda s: s.stat().st_mtime)
    return repo.name.removeprefix("models--").replace("--", "/"), chosen


def _has_config(snapshot: Path) -> bool:
    return (snapshot / "config.json").is_file() or (snapshot / "model_index.json").is_file()


def _builtin_name(model: str) -> str | None:
    return next(
        (name for name in families.published_configs() if name.lower() == model.lower()), None
    )


def _hinted(message: str, name: str, known: list[str]) -> str:
    """`message`, then the known name closest to `name` (ids match case-insensitively)."""
    hint = did_you_mean(name, known, ignore_case=True)
    return f"{message}; {hint}" if hint else message


# --- picking a component out of a model's config files ----------------------------------


# Keys of a multi-part model's model_index.json that its parts' configs may lack.
_INDEX_FACTS = ("num_code_groups", "sample_rate", "samples_per_frame")

# Key spellings normalised to the catalog's (transformers' attribute_map for MoE and
# GPT-2-style configs).
_ALIASES = {
    "num_local_experts": "num_experts",
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}


def _load(model: str, component: str | None, files: _Files, source: str) -> ComponentConfig:
    index = files.json("model_index.json")
    if index is not None:
        return _load_diffusers(model, component, files, index, source)
    root = files.json("config.json")
    if root is None:
        raise ModelConfigError(f"model '{model}' has neither config.json nor model_index.json")
    architecture = root.get("model_type")
    parts = _parts(architecture)
    if not parts:
        root = _normalised(root)
        if component is not None:
            raise UnknownComponent(
                f"model '{model}' is a single-part model; it has no component '{component}' "
                "(leave component unset to use the whole model)"
            )
        category = _whole_category(root, model)
        # Counted too, for architectures the LM formula does not cover.
        whole = {"num_parameters": ("", ("",))}
        dtype = _dtype_of(root)
        return _finish(model, None, category, root, files, whole, dtype, source, (architecture,))
    part = parts[_require_component(model, component, sorted(parts))]
    levels = _levels(files, part, model)
    config = _flatten(levels, part)
    counts = (
        dict(part.extras) if part.category in LM_CATEGORIES else {"num_parameters": part.weights}
    )
    rel_dir = os.path.dirname(part.file)
    requests = {name: (rel_dir, prefixes) for name, prefixes in counts.items()}
    dtype = part.dtype or _dtype_of(*levels)
    return _finish(
        model,
        component,
        part.category,
        config,
        files,
        requests,
        dtype,
        source,
        (architecture,),
        part,
    )


def _parts(architecture: str | None) -> dict[str, Part]:
    """The components its family says a checkpoint of `architecture` has ({}: none known)."""
    family = families.for_architecture(architecture)
    return dict(family.parts) if family is not None else {}


def _whole_category(config: Mapping[str, Any], model: str) -> str:
    """What a single-part checkpoint is sized as: its family's say, else a language model."""
    family = families.for_architecture(config.get("model_type"))
    if family is not None and family.whole is not None:
        return family.whole
    return _lm_category(config, model)


def _load_diffusers(model, component, files, index, source) -> ComponentConfig:
    cfg = _load_diffusers_part(model, component, files, index, source)
    pipeline = index.get("_class_name")
    family = families.for_architecture(pipeline)
    facts = family.pipeline_facts.get(pipeline, {}) if family is not None else {}
    if callable(facts):  # facts that depend on the pipeline's own config (its index)
        facts = facts(index)
    for key, value in facts.get(cfg.component, {}).items():
        cfg.config.setdefault(key, value)
    return cfg


def _load_diffusers_part(model, component, files, index, source) -> ComponentConfig:
    available = sorted(
        name
        for name, entry in index.items()
        if isinstance(entry, list) and files.json(f"{name}/config.json") is not None
    )
    component = _require_component(model, component, available)
    config = dict(files.json(f"{component}/config.json"))
    class_name = config.get("_class_name")
    if class_name is None and not str(index.get("_class_name", "")).endswith("Pipeline"):
        return _load_speech_part(model, component, config, index, files, source)
    if class_name is None:
        return _load_text_encoder(model, component, config, files, index, source)
    if class_name.startswith("Autoencoder"):
        category = "vae"
    elif "Transformer" in class_name:
        category = "dit"
        vae = files.json("vae/config.json")
        scale = vae_scale_factor(vae) if vae else None
        if scale is not None:
            config.setdefault("vae_scale_factor", scale)
            config.setdefault("vae_scale_factor_temporal", vae_temporal_factor(vae))
    else:
        raise ModelConfigError(
            f"model '{model}': component '{component}' is a {class_name}, which omniflow "
            "cannot estimate (known: DiT transformers, autoencoders, transformers text encoders)"
        )
    requests = {"num_parameters": (component, ("",))}
    dtype, architectures = _dtype_of(config), (index.get("_class_name"),)
    return _finish(
        model, component, category, config, files, requests, dtype, source, architectures
    )


def _load_speech_part(model, component, config, index, files, source) -> ComponentConfig:
    """A transformers part of a multi-part model that is not a diffusers pipeline (tiny:tts:
    a codec LM and its codec). A codec is the vocoder, any other part a language model; the
    index's audio facts (codebooks per frame, sample rate, samples per frame) fill in what
    the part's own config does not say.
    """
    for key in _INDEX_FACTS:
        if key in index:
            config.setdefault(key, index[key])
    category = _whole_category(_normalised(config), model)
    requests = {"num_parameters": (component, ("",))}
    dtype = _dtype_of(config)
    architectures = (index.get("_class_name"), config.get("model_type"))
    return _finish(
        model, component, category, config, files, requests, dtype, source, architectures
    )


def _load_text_encoder(model, component, root, files, index, source) -> ComponentConfig:
    """A transformers model a diffusers pipeline runs as its prompt encoder.

    The pipeline loads the whole model, so a multi-part one (Qwen-Image's Qwen2.5-VL) is its
    language part plus every other part counted as an extra.
    """
    architectures = (index.get("_class_name"), root.get("model_type"))
    parts = _parts(architectures[1])
    dtype = _dtype_of(root)
    if not parts:
        _lm_category(_normalised(root), model)
        whole = {"num_parameters": (component, ("",))}
        return _finish(
            model, component, "text_encoder", root, files, whole, dtype, source, architectures
        )
    text = next(part for part in parts.values() if part.category in LM_CATEGORIES)
    levels = [root, *_descend(root, text.path, model)]
    extras = {name: (component, part.weights) for name, part in parts.items() if part is not text}
    # Counted too, for text encoders the LM formula does not cover (a T5 encoder).
    extras["num_parameters"] = (component, text.weights)
    config = _flatten(levels, text)
    return _finish(
        model, component, "text_encoder", config, files, extras, dtype, source, architectures
    )


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    config = dict(config)
    for old, new in _ALIASES.items():
        if old in config:
            config.setdefault(new, config.pop(old))
    return config


def _finish(
    model, component, category, config, files, requests, dtype, source, architectures, part=None
) -> ComponentConfig:
    config = _normalised(config)
    extras = {}
    for name, (rel_dir, prefixes) in requests.items():
        counted = files.count(component, name, rel_dir, prefixes)
        if not counted:
            continue
        if name == "num_parameters":
            config["num_parameters"] = counted
        else:
            extras[name] = counted
    if extras:
        config["extra_parameters"] = extras
    for key, value in _builtin_facts(model, component).items():
        config.setdefault(key, value)
    architectures = tuple(a for a in architectures if a)
    return ComponentConfig(model, component, category, config, dtype, source, architectures, part)


def _require_component(model: str, component: str | None, available: list[str]) -> str:
    if component is None:
        raise ModelConfigError(
            f"model '{model}' has several components; name one of: {', '.join(available)}"
        )
    if component not in available:
        raise UnknownComponent(
            _hinted(
                f"model '{model}' has no component '{component}'; its components are: "
                f"{', '.join(available)}",
                component,
                available,
            )
        )
    return component


def _levels(files: _Files, part: Part, model: str) -> list[dict[str, Any]]:
    root = files.json(part.file)
    if root is None:
        raise ModelConfigError(f"model '{model}' has no {part.file}")
    return [root, *_descend(root, part.path, model)]


def _descend(root: dict[str, Any], path: tuple[str, ...], model: str) -> list[dict[str, Any]]:
    levels, node = [], root
    for step in path:
        key = step.rstrip("?")
        if key in node:
            node = node[key]
            levels.append(node)
        elif not step.endswith("?"):
            raise ModelConfigError(f"model '{model}': config has no '{key}' section")
    return levels


def _flatten(levels: list[dict[str, Any]], part: Part) -> dict[str, Any]:
    *upper, deepest = levels
    config: dict[str, Any] = dict(part.defaults)
    for level in upper:
        config.update((k, v) for k, v in level.items() if not isinstance(v, dict) or k in part.keep)
    config.update(deepest)
    for key, name in part.renames.items():
        if key in config:
            config.setdefault(name, config[key])
    if part.category in LM_CATEGORIES:
        owner = levels[len(levels) - 1 if part.class_level is None else part.class_level]
        # transformers' default when the owning config does not say.
        config["tie_word_embeddings"] = owner.get("tie_word_embeddings", False)
    return config


def _lm_category(config: Mapping[str, Any], model: str) -> str:
    if not all(k in config for k in ("hidden_size", "num_hidden_layers", "vocab_size")):
        raise ModelConfigError(
            f"model '{model}' ({config.get('model_type', 'no model_type')}) is not a decoder "
            "language model omniflow can size: its config lacks hidden_size, "
            "num_hidden_layers or vocab_size"
        )
    return "moe_lm" if config.get("num_experts", 0) > 0 else "decoder_lm"


def _dtype_of(*levels: Mapping[str, Any]) -> str:
    for level in reversed(levels):
        stated = level.get("torch_dtype") or level.get("dtype")
        if isinstance(stated, str) and canonical_dtype(stated) in STAGE_DTYPES:
            return canonical_dtype(stated)
    return "bfloat16"


# --- the builtin catalog ------------------------------------------------------------------


def _builtin_counts(model: str, component: str | None) -> dict[str, int]:
    return families.published_configs()[model].get("parameter_counts", {}).get(component or "", {})


def _builtin_facts(model: str, component: str | None) -> dict[str, Any]:
    entry = families.published_configs().get(model, {})
    return entry.get("facts", {}).get(component or "", {})

"""What a model family tells omniflow: the descriptor every family folder fills in.

A family (Qwen2.5-Omni, Qwen-Image, the audio codecs, ...) is one folder under
`omniflow/families/`. Its `__init__.py` defines `FAMILY`, a `Family`, and imports nothing
heavier than this module and its cost formulas (its `costs.py`, written in
`omniflow.catalog.costs`' counting pieces), all torch-free: the compiler reads every
family's descriptor. The descriptor has two halves:

- facts the compiler reads, as data and small torch-free functions: how each component sits
  in the published config files (`Part`), the published configs themselves (the folder's
  `configs/*.json`, the builtin catalog's entries), what a diffusers pipeline's own code
  decides that no config states, the formulas its components' memory and FLOPs are
  estimated by, the adapters of the edges between its stages, its tiny and real-size
  random-weight checkpoints and the hub ids they stand in for;
- dotted paths ("module:name") into its run-time half (components, decoders, adapter code,
  speaker readers, checkpoint builders), which `lower` writes into the plan and an executor
  imports only when a stage loads such a model. The compiler never imports them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omniflow.ir.kinds import ParamSpec


@dataclass(frozen=True)
class Part:
    """How one component of a multi-part transformers model sits in its config files.

    `path` descends from the file's root to the component's dims; a step ending in '?' is
    optional (Qwen2.5-VL keeps its text dims at the root in older exports). The flat config
    is every level along the path merged, deeper levels winning, but sub-config dicts of
    upper levels are dropped except those named in `keep`. `class_level` is the level whose
    `tie_word_embeddings` the owning transformers class reads. `weights` are checkpoint
    name prefixes of the whole component, `extras` of modules counted beside an LM's formula.
    `category` is what the compiler sizes it as (`omniflow.catalog.CATEGORIES`).

    `renames` gives config keys the catalog's names (a T5 encoder's `d_model` is its
    `hidden_size`), kept beside the part's own.

    A vocoder part whose config layout the generic rules do not read says how many samples
    it makes per codec frame (`samples_per_frame`), and one that decodes on a grid of blocks
    the grid: `block_grid(config)` -> (codes per block, codes of lookahead); one whose decoder
    is causal and carries each stream's state from one window to the next (`carries_state`:
    its windows need no left context and cost only their new frames) says so, and its
    decoder is then `stateful` (omniflow.backends.vocoders). An encoder part
    whose `hidden` output is wider than the width its config names says how wide
    (`hidden_width(config)`: a vision tower that sends features of its inner layers beside
    its embeddings, as Qwen3-Omni's deepstack tower does). An LM part whose prompt is built
    from another stage's prompt plus rows of its own (a talker's: its thinker's prompt, then
    its speaker and first reply rows) says how many positions it adds at most
    (`added_positions`): its cache holds them beyond `max_len` + `max_tokens`, so a thinker
    prompt at its `max_len` still fits the talker. What a part costs is its family's
    `cost` rule's (or the generic rules'), which `defaults` may feed with facts its config
    leaves out.
    """

    category: str
    path: tuple[str, ...]
    file: str = "config.json"
    class_level: int | None = None
    keep: tuple[str, ...] = ()
    weights: tuple[str, ...] = ("",)
    extras: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    renames: Mapping[str, str] = field(default_factory=dict)
    dtype: str | None = None
    samples_per_frame: Callable[[Mapping[str, Any]], int] | None = None
    block_grid: Callable[[Mapping[str, Any]], tuple[int, int]] | None = None
    carries_state: bool = False
    hidden_width: Callable[[Mapping[str, Any]], int] | None = None
    added_positions: int = 0


@dataclass(frozen=True)
class AdapterSpec:
    """A named transition function an edge applies on the way (`adapter=family.name`).

    The compiler checks an edge's adapter against the types; the runtime imports `impl`
    ("module:function", a factory called with the source `StagePlan`) when it links the
    plan. What the adapter needs its source `hidden` port to send per step: `source_rows`
    rows of the hidden size, and (if `with_prompt`) a step for every prompt position too.
    """

    in_type: str
    out_type: str
    impl: str
    doc: str
    source_rows: int = 1
    with_prompt: bool = False


@dataclass(frozen=True)
class TinyModel:
    """A tiny random-weight checkpoint of the family's real architecture, `tiny:NAME`.

    `build` ("module:function") writes it into an empty directory and yields the label of
    each of `parts` just before building it; `counterparts` are the real hub ids that
    `--tiny` swaps for it.
    """

    name: str
    description: str
    parts: tuple[str, ...]
    build: str
    counterparts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """One model family. `architectures` are the names its checkpoints declare: a
    `config.json`'s `model_type`, or a `model_index.json`'s `_class_name`.

    - `parts`: component name -> `Part`, for multi-part transformers checkpoints;
    - `whole`: the category of a single-part checkpoint of the family where the generic
      rules cannot tell (an audio codec is a "vocoder");
    - `pipeline_facts`: pipeline class -> component -> facts a diffusers pipeline's
      `__call__` decides that no component config states (or a small torch-free function
      of the checkpoint's `model_index.json` that returns them, where they depend on the
      pipeline's own config);
    - `runtime`: (stage kind, backend) -> "module:callable", the family's code for that
      backend (what it is called with is the backend's contract: docs/backends.md);
    - `adapters`: "namespace.name" -> `AdapterSpec`;
    - `speakers`: "module:function", the speakers of a local checkpoint (None if none);
    - `admission`: "module:function(stage, path)", the family's own checks of a request
      against a local checkpoint, made at admission (a task the checkpoint does not do, a
      language it does not speak): a function of (the stage's parameters, its inputs
      from the pipeline's) that raises `omniflow.runtime.requests.StageRequestError`
      naming the parameter or input port; None where it has none for that stage;
    - `media_tokens`: "module:function(stage, path)", the embeddings each media item gives
      a stage (an encoder's tower) of a local checkpoint, from the item's size alone: a
      function of (kind: "audio", "image" or "video"; the item as the stage takes it) that
      returns a count, 0 where it cannot tell; None for a stage it does not count.
      Admission counts a request's media with it against that stage's `max_len`, and
      against the `max_len` of an `ar` stage whose prompt holds their embeddings;
    - `voices`: "module:function(path)", torch-free: whether the checkpoint at `path`
      clones voices (a stage of the plan encodes their reference clips; the server asks
      before it sends an upload there, `omniflow.server.voices`);
    - `stage_params`, `stage_inputs`, `stage_outputs`: stage kind -> parameters
      (`ParamSpec`s), input ports (-> accepted types) and output ports (-> type) a stage of
      that kind has when it runs one of the family's models, beyond the kind's own (a TTS
      talker's `language`, `ref_audio`; a voice encoder's `voice`); the request fields of
      the same names reach the inputs;
    - `prompt_inputs`: stage kind -> the input ports (beyond the kind's `prompt`) whose text
      a stage of that kind puts into its prompt when it runs one of the family's models (a
      TTS talker's `instructions` and `ref_text`): admission counts them against the
      stage's prompt length with the prompt's own;
    - `cost`: its cost rule, a torch-free function of a component (`omniflow.catalog`'s
      `ComponentConfig`) that returns the `omniflow.catalog.costs.Estimator` its formulas
      make of it (an `LM` with its decoders' layout defaults, a `DiT` or `Vocoder` subclass
      with its architecture's counts), or None where it has none. The compiler asks the
      families that know the component first, then every other (a bare config knows none:
      a rule tells its own by the config's `model_type`, `_class_name` or keys), and falls
      back on the generic rules (Llama-layout decoders, encoders, AutoencoderKL, the
      checkpoint's count);
    - `tiny`: its tiny checkpoints;
    - `scaled`: real model id -> "module:function(out, depth, device)", a builder of a
      real-size random-weight checkpoint of it (for measuring on a GPU).
    """

    name: str
    doc: str
    architectures: tuple[str, ...]
    parts: Mapping[str, Part] = field(default_factory=dict)
    whole: str | None = None
    pipeline_facts: Mapping[str, Mapping[str, Mapping[str, Any]] | Callable[..., Any]] = field(
        default_factory=dict
    )
    runtime: Mapping[tuple[str, str], str] = field(default_factory=dict)
    adapters: Mapping[str, AdapterSpec] = field(default_factory=dict)
    speakers: str | None = None
    admission: str | None = None
    media_tokens: str | None = None
    voices: str | None = None
    stage_params: Mapping[str, Mapping[str, ParamSpec]] = field(default_factory=dict)
    stage_inputs: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)
    stage_outputs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    prompt_inputs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    cost: Callable[[Any], Any] | None = None
    tiny: tuple[TinyModel, ...] = ()
    scaled: Mapping[str, str] = field(default_factory=dict)
    # The folder of its published configs (set by the registry for a family folder; a
    # family registered from elsewhere may point at its own, or have none).
    configs: str | None = None


def diffusers_runtime(package: str) -> dict[tuple[str, str], str]:
    """`Family.runtime` of a diffusers pipeline family: its encoder, diffusion and vae stages
    all run by the `PIPELINES` object of its module `package.pipeline`."""
    pipelines = f"{package}.pipeline:PIPELINES"
    return {(kind, "diffusers"): pipelines for kind in ("encoder", "diffusion", "vae")}


def local_config(path: str | Path, architecture: str) -> dict | None:
    """A local checkpoint's config.json if its `model_type` is `architecture`, else None (a
    family's `speakers` or `voices` reads it without loading the model)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    layout = json.loads(config.read_text(encoding="utf-8"))
    return layout if layout.get("model_type") == architecture else None

"""omniflow.families: the model families omniflow knows, registered in one place.

Each folder here is one family (`family.py` says what its `FAMILY` descriptor holds);
`BUILTIN` lists them. A family from anywhere else (a user's own package) joins by its
module's name in the `OMNIFLOW_FAMILIES` environment variable (comma-separated: every
process that compiles or serves a plan reads it), or by `register` in a running process. Every table the compiler and the runtime consult about models is a view of the
registered families, computed here: which family serves a checkpoint's architecture, the
builtin catalog of published configs, the named adapters, the tiny checkpoints and the
real models they stand in for. Nothing outside the families names a family.

Importing this package imports every builtin family's descriptor, which is torch-free; a
family's run-time half is imported only by the executor that runs it, by the dotted path
`lower` wrote into the plan.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from collections.abc import Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from omniflow.errors import OmniflowError
from omniflow.families.family import AdapterSpec, Family, Part, TinyModel
from omniflow.ir.kinds import ParamSpec
from omniflow.plan import FamilyCode

__all__ = [
    "AdapterSpec",
    "Family",
    "Part",
    "TinyModel",
    "adapters",
    "families",
    "for_architecture",
    "model_ids",
    "published_configs",
    "register",
    "stage_code",
    "tiny_counterpart",
    "tiny_models",
    "unregister",
]

# The family folders of this package, in the order their tables list them.
BUILTIN = (
    "qwen2_lm",
    "qwen2_5_omni",
    "qwen2_5_vl",
    "qwen_image",
    "codec_tts",
    "audio_codecs",
    "qwen3_omni",
    "qwen3_tts",
    "wan",
)


# Modules (each defining FAMILY) registered beside the builtin families in every process.
PLUGINS_ENV = "OMNIFLOW_FAMILIES"


class FamilyError(OmniflowError):
    """A family cannot be registered: it claims what another family already has."""


_registered: dict[str, Family] = {}


def _builtin(name: str) -> Family:
    family = importlib.import_module(f"{__name__}.{name}").FAMILY
    folder = resources.files(f"{__name__}.{name}") / "configs"
    if family.configs is None and folder.is_dir():
        family = replace(family, configs=str(folder))
    return family


@functools.cache
def _builtins() -> tuple[Family, ...]:
    """The builtin families, then those `OMNIFLOW_FAMILIES` names."""
    loaded: list[Family] = [_builtin(name) for name in BUILTIN]
    for module in filter(None, map(str.strip, os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            family = importlib.import_module(module).FAMILY
        except (ImportError, AttributeError) as err:
            raise FamilyError(
                f"{PLUGINS_ENV}: cannot load a family from '{module}': {err}"
            ) from err
        _check_claims(family, loaded)
        loaded.append(family)
    return tuple(loaded)


def families() -> tuple[Family, ...]:
    """Every registered family: the builtin ones, then those registered since."""
    return _builtins() + tuple(_registered.values())


def register(family: Family) -> Family:
    """Add `family` to this process's registry; what it claims (architectures, adapters,
    tiny models, counterparts) must be its own."""
    _check_claims(family, families())
    _registered[family.name] = family
    _clear_views()
    return family


def unregister(name: str) -> None:
    """Remove a family that `register` added."""
    if _registered.pop(name, None) is None:
        raise FamilyError(f"no family '{name}' was registered (builtin ones stay)")
    _clear_views()


def _check_claims(family: Family, others: Sequence[Family]) -> None:
    for other in others:
        if other.name == family.name:
            raise FamilyError(f"a family named '{family.name}' is registered already")
        for what, mine, theirs in _claims(family, other):
            if mine & theirs:
                raise FamilyError(
                    f"family '{family.name}' claims {what} {', '.join(sorted(mine & theirs))}, "
                    f"which family '{other.name}' has"
                )


def _claims(a: Family, b: Family):
    yield "architectures", set(a.architectures), set(b.architectures)
    yield "adapters", set(a.adapters), set(b.adapters)
    yield "tiny models", {t.name for t in a.tiny}, {t.name for t in b.tiny}
    yield "counterparts", _lowered_counterparts(a), _lowered_counterparts(b)
    for kind in set(a.stage_params) & set(b.stage_params):  # a name means one thing a kind
        ours, theirs = a.stage_params[kind], b.stage_params[kind]
        differ = {n for n in set(ours) & set(theirs) if ours[n] != theirs[n]}
        yield f"{kind} parameters (with other specs)", differ, differ


def _lowered_counterparts(family: Family) -> set[str]:
    return {c.lower() for t in family.tiny for c in t.counterparts}


def _clear_views() -> None:
    views = (_by_architecture, adapters, tiny_models, _counterparts, published_configs)
    for view in (*views, extra_params, extra_inputs, extra_outputs):
        view.cache_clear()


@functools.cache
def _by_architecture() -> dict[str, Family]:
    return {arch: f for f in families() for arch in f.architectures}


def for_architecture(architecture: str | None) -> Family | None:
    """The family whose checkpoints declare `architecture`, or None."""
    return _by_architecture().get(architecture or "")


def knowing(architectures: Sequence[str]) -> list[Family]:
    """The families that know a component's `architectures` (outermost first)."""
    return [f for f in map(for_architecture, architectures) if f is not None]


def stage_code(architectures: Sequence[str], kind: str) -> FamilyCode | None:
    """What the families that know a component's `architectures` (outermost first) give a
    stage of `kind`: their code by backend (an outer family's first), the speaker reader,
    admission checks, media count and voice encoder, named after the outermost, and every
    input port they put into its prompt; None when no family knows any of them."""
    known = knowing(architectures)
    if not known:
        return None
    code: dict[str, str] = {}
    for family in reversed(known):
        code |= {backend: path for (k, backend), path in family.runtime.items() if k == kind}
    first = {
        what: next((getattr(f, what) for f in known if getattr(f, what)), "")
        for what in ("speakers", "admission", "media_tokens", "voices")
    }
    prompt = [port for f in known for port in f.prompt_inputs.get(kind, ())]
    return FamilyCode(known[0].name, code, **first, prompt_inputs=list(dict.fromkeys(prompt)))


@functools.cache
def extra_params(kind: str) -> dict[str, ParamSpec]:
    """The parameters some family lets a stage of `kind` take beyond the kind's own."""
    return {name: spec for f in families() for name, spec in f.stage_params.get(kind, {}).items()}


@functools.cache
def extra_inputs(kind: str) -> dict[str, tuple[str, ...]]:
    """The input ports some family lets a stage of `kind` take beyond the kind's own."""
    return {port: types for f in families() for port, types in f.stage_inputs.get(kind, {}).items()}


@functools.cache
def extra_outputs(kind: str) -> dict[str, str]:
    """The output ports (and their types) some family lets a stage of `kind` have beyond
    the kind's own."""
    return {port: typ for f in families() for port, typ in f.stage_outputs.get(kind, {}).items()}


@functools.cache
def adapters() -> dict[str, AdapterSpec]:
    """Every named adapter, by the name an edge gives it (`namespace.name`)."""
    return {name: spec for f in families() for name, spec in f.adapters.items()}


@functools.cache
def tiny_models() -> dict[str, TinyModel]:
    """Every tiny checkpoint, by its name (`tiny:NAME`)."""
    return {t.name: t for f in families() for t in f.tiny}


@functools.cache
def _counterparts() -> dict[str, str]:
    return {c.lower(): t.name for f in families() for t in f.tiny for c in t.counterparts}


def tiny_counterpart(model: str) -> str | None:
    """The tiny checkpoint that stands in for the real `model` (matched case-insensitively)."""
    return _counterparts().get(model.lower())


def counterparts() -> dict[str, str]:
    """Real model id -> the name of its tiny checkpoint, for every family."""
    return {c: t.name for f in families() for t in f.tiny for c in t.counterparts}


@functools.cache
def published_configs() -> dict[str, dict[str, Any]]:
    """The builtin catalog: every family's published configs (`configs/*.json`), by model id."""
    return {entry["model"]: entry for family in families() for entry in _config_entries(family)}


def _config_entries(family: Family) -> list[dict[str, Any]]:
    if family.configs is None:
        return []
    paths = sorted(Path(family.configs).glob("*.json"))
    return [json.loads(path.read_text(encoding="utf-8")) for path in paths]


def model_ids(family: Family) -> list[str]:
    """The real hub ids `family` names: those its tiny checkpoints stand in for, then its
    published configs' and its real-size builders' (each once, in that order)."""
    named = [c for t in family.tiny for c in t.counterparts]
    named += [entry["model"] for entry in _config_entries(family)]
    return list(dict.fromkeys([*named, *family.scaled]))

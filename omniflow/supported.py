"""The models supported: every real hub id a registered family names, with the example graph
that serves it and its tiny and real-size random-weight builds.

`omniflow models list` prints it, and docs/models.md carries it as a table that
`supported_models_markdown` writes (tests/test_supported.py keeps the two equal).
An example graph serves a model (a hub id, or a checkpoint folder by the architecture its
config declares) when it names it, or names another model of the same family and
architecture (a sibling size, another checkpoint of the same classes): which graph serves
what is read off graphs/*.omni, never kept beside them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from omniflow import families
from omniflow.catalog.resolve import TINY_SCHEME
from omniflow.examples import example_graphs


@dataclass(frozen=True)
class SupportedModel:
    model: str  # the hub id
    family: str
    graph: str | None  # the example graph that serves it (its stem), or None
    named: bool  # whether that graph names this model (else it is another of its family)
    tiny: str | None  # the tiny checkpoint `--tiny` swaps in for it
    scaled: bool  # whether `omniflow models build-scaled` builds it at real size


# The files whose fields name a checkpoint's architecture (`Family.architectures`).
DECLARING_FILES = ("config.json", "model_index.json")


def architecture(model: str) -> str | None:
    """The architecture a checkpoint folder's config declares, or for a hub id its published
    config's; None where there is none."""
    folder = Path(model)
    if folder.is_dir():
        files = {
            name: json.loads((folder / name).read_text(encoding="utf-8"))
            for name in DECLARING_FILES
            if (folder / name).is_file()
        }
    else:
        files = families.published_configs().get(model, {}).get("files", {})
    model_type = files.get("config.json", {}).get("model_type")
    return model_type or files.get("model_index.json", {}).get("_class_name")


@functools.cache
def _family_by_model() -> dict[str, families.Family]:
    return {m: f for f in families.families() for m in families.model_ids(f)}


def family_of(model: str) -> families.Family | None:
    """The family that names `model` (hub ids match case-insensitively), or whose
    architecture a checkpoint folder declares."""
    if Path(model).is_dir():
        return families.for_architecture(architecture(model))
    by_lower = {m.lower(): f for m, f in _family_by_model().items()}
    return by_lower.get(model.lower())


def graph_models() -> dict[str, str]:
    """Each example graph's model (its `model` line), by the graph's stem; graphs on a tiny
    model of their own serve no real one."""
    from omniflow.compiler import load_graph

    models = {stem: load_graph(path).model for stem, path in example_graphs().items()}
    return {stem: m for stem, m in models.items() if m and not m.startswith(TINY_SCHEME)}


def serving_graph(model: str) -> tuple[str | None, bool]:
    """The example graph that serves `model`, and whether it names it: one that does, else
    one on a model of the same family whose architecture does not differ; (None, False)."""
    graphs = graph_models()
    for stem, named in graphs.items():
        if named.lower() == model.lower():
            return stem, True
    family, kind = family_of(model), architecture(model)
    for stem, named in graphs.items():
        theirs = architecture(named)
        if family is not None and family_of(named) is family and kind in (None, theirs):
            return stem, False
    return None, False


def supported_models() -> list[SupportedModel]:
    """Every real model the registered families name, family by family."""
    supported = []
    for family in families.families():
        for model in families.model_ids(family):
            graph, named = serving_graph(model)
            tiny = families.tiny_counterpart(model)
            scaled = model in family.scaled
            supported.append(SupportedModel(model, family.name, graph, named, tiny, scaled))
    return supported


def supported_models_markdown() -> str:
    """docs/models.md's table of the models supported."""
    rows = [
        "| model | family | example graph | tiny build | real-size random weights |",
        "|---|---|---|---|---|",
    ]
    for m in supported_models():
        graph = "-" if m.graph is None else f"`graphs/{m.graph}.omni`"
        if m.graph is not None and not m.named:
            graph += " (its family's; `--model` serves this one)"
        tiny = f"`tiny:{m.tiny}`" if m.tiny else "-"
        scaled = "`build-scaled`" if m.scaled else "-"
        rows.append(f"| `{m.model}` | `{m.family}` | {graph} | {tiny} | {scaled} |")
    return "\n".join(rows) + "\n"

"""The compiler's phases as named functions: parse -> settings -> build -> passes -> lower.

compile_file("x.omni", devices="2xH200")    # -> Plan
optimize_file("x.omni", devices="2xH200")   # -> Graph after the passes (str() shows the facts)
load_graph("x.omni")                        # -> Graph (parsed and built, no passes)
load_graph("x.omni", ["thinker.max_batch=8"])  # ... with a stage argument set (`--set`)
settings_by_pipeline(programs, settings)    # -> each served pipeline's settings
flags_that_fit("x.omni", "cpu")             # -> ["--devices 2xH200", "--tiny"]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from pathlib import Path

from omniflow.catalog.resolve import model_path, use_tiny_models
from omniflow.devices import parse_devices
from omniflow.dsl import ast
from omniflow.dsl.parser import parse, parse_file
from omniflow.errors import (
    GraphError,
    ModelConfigError,
    PassError,
    PlacementError,
    SourceError,
    Span,
)
from omniflow.hints import did_you_mean
from omniflow.ir.from_ast import build
from omniflow.ir.graph import Graph
from omniflow.lower import lower
from omniflow.passes.pipeline import PassHook, Target, run_passes
from omniflow.plan import Plan

# The inventories tried for a graph that does not fit the machine at hand, smallest first:
# `compile` suggests the first that holds it.
SUGGESTED_INVENTORIES = ("1xH200", "2xH200", "4xH200", "8xH200")


def graph_from_source(text: str, path: str = "<string>", settings: Sequence[str] = ()) -> Graph:
    return build(with_settings(parse(text, path), settings))


def load_graph(path: str | Path, settings: Sequence[str] = ()) -> Graph:
    """The file's graph, built with `settings` (`--set STAGE.KEY=VALUE`) in its stages."""
    return build(with_settings(parse_file(path), settings))


def with_settings(program: ast.Pipeline, settings: Sequence[str]) -> ast.Pipeline:
    """`program` with each `[PIPELINE.]STAGE.KEY=VALUE` of `settings` (`--set`) as that
    stage's argument, in place of the one it has or added to it. VALUE is written as in the
    file (`8`, `"cuda"`, `$max_tokens`) and checked by the build as if it were there; an
    error in a setting points at the setting as given. A setting that names a pipeline must
    name this one (`settings_by_pipeline` sorts those of several)."""
    if not settings:
        return program
    program = copy.deepcopy(program)
    stages = {s.name: s for s in program.stages}
    for setting in settings:
        pipeline, name, key, value = _split_setting(setting)
        if pipeline not in (None, program.name):
            raise GraphError(
                f"this pipeline is '{program.name}', not '{pipeline}'",
                _whole(setting),
                hint=f"--set {program.name}.{name}.{key}={value}, or --set {name}.{key}={value}",
            )
        stage = stages.get(name)
        if stage is None:
            hint = did_you_mean(name, stages) or f"its stages: {', '.join(stages)}"
            raise GraphError(
                f"pipeline '{program.name}' has no stage '{name}'", _whole(setting), hint=hint
            )
        arg = _setting_arg(stage, name, key, value, setting)
        stage.args = [a for a in stage.args if a.key != key] + [arg]
    return program


def settings_by_pipeline(
    programs: Sequence[ast.Pipeline], settings: Sequence[str]
) -> list[list[str]]:
    """`settings` of pipelines served together, sorted: each program's (in their order). A
    setting naming its pipeline (`PIPELINE.STAGE.KEY=VALUE`) goes to that one; one without
    (`STAGE.KEY=VALUE`) to every pipeline with that stage. A setting that fits none of them
    is an error pointing at it."""
    if len(programs) == 1:
        return [list(settings)]  # (`with_settings` checks them against it)
    names = {p.name: {s.name for s in p.stages} for p in programs}
    by_program: list[list[str]] = [[] for _ in programs]
    for setting in settings:
        pipeline, name, _, _ = _split_setting(setting)
        if pipeline is not None and pipeline not in names:
            hint = did_you_mean(pipeline, names) or f"served: {', '.join(names)}"
            raise GraphError(f"no served pipeline is '{pipeline}'", _whole(setting), hint=hint)
        takers = [
            i for i, p in enumerate(programs)
            if p.name == pipeline or (pipeline is None and name in names[p.name])
        ]  # fmt: skip
        if pipeline is None and not takers:
            every = {stage for stages in names.values() for stage in stages}
            hint = did_you_mean(name, every) or "name its pipeline: PIPELINE.STAGE.KEY=VALUE"
            raise GraphError(f"no served pipeline has a stage '{name}'", _whole(setting), hint=hint)
        for i in takers:
            by_program[i].append(setting)
    return by_program


def _split_setting(setting: str) -> tuple[str | None, str, str, str]:
    """(pipeline or None, stage, key, value) of `[PIPELINE.]STAGE.KEY=VALUE`."""
    target, _, value = setting.partition("=")
    parts = target.split(".")
    if len(parts) not in (2, 3) or not (all(parts) and value):
        raise GraphError(
            "a setting is [PIPELINE.]STAGE.KEY=VALUE",
            _whole(setting),
            hint="e.g. --set thinker.max_batch=8",
        )
    pipeline = parts[0] if len(parts) == 3 else None
    return pipeline, parts[-2], parts[-1], value


def _whole(setting: str) -> Span:
    return Span("--set", 1, 1, len(setting) + 1, setting)


def _setting_arg(stage: ast.StageDecl, name: str, key: str, value: str, setting: str) -> ast.Attr:
    """The argument `key=value` parsed as the file's stage declaration would parse it, its
    spans moved onto `setting` as given."""
    prefix = f"pipeline p {{ stage {name} = {stage.kind}("
    # A column of the snippet -> one of the setting, where `key=value` ends both.
    shift = len(setting) - len(f"{key}={value}") - len(prefix)

    def moved(span: Span | None) -> Span | None:
        if span is None:
            return None
        col = min(max(1, span.col + shift), len(setting))
        end = min(max(col + 1, span.end_col + shift), len(setting) + 1)
        return dataclasses.replace(span, path="--set", col=col, end_col=end, line_text=setting)

    try:
        arg = parse(f"{prefix}{key}={value}) }}", "--set").stages[0].args[0]
    except SourceError as err:  # (its hint would speak of the snippet's brackets)
        hint = 'VALUE is written as in the .omni file: 8, "cuda", $max_tokens'
        raise type(err)(err.message, moved(err.span), hint) from None
    return dataclasses.replace(arg, span=moved(arg.span), value_span=moved(arg.value_span))


def optimize(graph: Graph, devices: str = "cpu", on_pass: PassHook | None = None) -> Graph:
    return run_passes(graph, Target(tuple(parse_devices(devices))), on_pass=on_pass)


def compile_graph(graph: Graph, devices: str = "cpu", on_pass: PassHook | None = None) -> Plan:
    """`on_pass`: told of each pass as it finishes (run_passes)."""
    return lower(optimize(graph, devices, on_pass))


def compile_source(
    text: str, path: str = "<string>", devices: str = "cpu", settings: Sequence[str] = ()
) -> Plan:
    return compile_graph(graph_from_source(text, path, settings), devices)


def optimize_file(
    path: str | Path,
    devices: str = "cpu",
    tiny: bool = False,
    progress: bool = False,
    on_pass: PassHook | None = None,
    model: str | None = None,
    settings: Sequence[str] = (),
) -> Graph:
    """The file's graph after the passes, what `lower` takes. `model`: serve it in place of
    the file's model line (`--model`). `settings`: stage arguments set (`--set`). `tiny`:
    swap every model for its built-in tiny counterpart (same architecture), built on first
    use (`progress`: with a progress bar)."""
    graph = load_graph(path, settings)
    if model:
        graph = with_model(graph, model)
    if tiny:
        graph = use_tiny_models(graph)
        for model in sorted({graph.model, *(s.params.get("model") for s in graph.stages)} - {None}):
            model_path(model, progress=progress)
    return optimize(graph, devices, on_pass)


def compile_file(path: str | Path, devices: str = "cpu", **options) -> Plan:
    """optimize_file's graph (`options`: its `tiny`, `progress`, `on_pass`, `model`,
    `settings`) lowered to a plan."""
    return lower(optimize_file(path, devices, **options))


def flags_that_fit(path: str | Path, here: str, settings: Sequence[str] = ()) -> list[str]:
    """The `compile` flags under which a graph (with `settings`) that does not fit `here`
    would: the smallest suggested inventory that holds it (`--devices 2xH200`), and `--tiny`
    when its tiny models fit `here`. Neither builds a checkpoint."""
    graph = load_graph(path, settings)
    fits = next((spec for spec in SUGGESTED_INVENTORIES if _places(graph, spec)), None)
    flags = [f"--devices {fits}"] if fits else []
    try:
        tiny = use_tiny_models(graph)
    except ModelConfigError:  # a model with no tiny counterpart
        tiny = None
    if tiny is not None and _places(tiny, here):
        flags.append("--tiny")
    return flags


def _places(graph: Graph, devices: str) -> bool:
    """Whether the passes place `graph` on `devices` (any other failure is raised)."""
    try:
        optimize(graph, devices)
    except PassError as err:
        if isinstance(err.cause, PlacementError):
            return False
        raise
    return True


def with_model(graph: Graph, model: str) -> Graph:
    """A copy of `graph` that serves `model` in place of its model line (stages that name a
    model of their own keep it). A model of another family than the line's is refused,
    naming the example graph that serves it."""
    from omniflow.supported import family_of, serving_graph

    if not graph.model:
        raise ModelConfigError(f"pipeline '{graph.name}' has no model line for --model to replace")
    ours, theirs = family_of(graph.model), family_of(model)
    if ours is not None and theirs is not None and ours is not theirs:
        serving, _ = serving_graph(model)
        where = f"; graphs/{serving}.omni serves it" if serving else ""
        raise ModelConfigError(
            f"--model {model}: pipeline '{graph.name}' serves {ours.name} models, and "
            f"{model} is a {theirs.name} model{where}"
        )
    graph = graph.copy()
    graph.model = model
    return graph

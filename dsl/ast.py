"""The `.omni` abstract syntax tree: plain dataclasses, each node carrying its source span.

The parser produces these; `omniflow.ir.from_ast.build` turns them into a `Graph`. Nothing
here resolves names or checks types: that is the build phase's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniflow.errors import Span


@dataclass(frozen=True)
class Auto:
    """The literal `auto` (e.g. `chunk=auto`)."""


AUTO = Auto()


@dataclass(frozen=True)
class Name:
    """A bare or dotted identifier used as a value (`qwen_omni.thinker_to_talker`, `negative_prompt`)."""

    dotted: str
    span: Span = field(compare=False)


# A value is a str, int, float, bool, AUTO, Param (omniflow.ir.values: `$name`, the one
# parameter reference from here to the plan), Name, or a list of values.
Value = object


@dataclass
class Attr:
    """`key=value`, or a bare flag `key` (value None), in a call or an attribute list."""

    key: str
    value: Value | None
    span: Span
    value_span: Span | None = None


@dataclass
class MapOp:
    """One pointwise op in a `map(...)` chain: `clamp(-1, 1)` or `pcm16`."""

    name: str
    args: list[Value]
    span: Span


@dataclass
class PortRef:
    """`stage.port` or just `stage` (port None: the build phase picks it by type)."""

    node: str
    port: str | None
    span: Span


@dataclass
class OutputRef:
    """`output name`: a pipeline output."""

    name: str
    span: Span


@dataclass
class ModelDecl:
    """`model "org/name"`: the default model of stages that name none."""

    model: str
    span: Span


@dataclass
class ParamDecl:
    """`param name = value`: a pipeline parameter with a default requests may override."""

    name: str
    default: Value
    span: Span


@dataclass
class StageDecl:
    """`stage name = kind(key=value, ...) @ device`."""

    name: str
    kind: str
    args: list[Attr]
    device: str | None
    span: Span
    kind_span: Span
    device_span: Span | None = None


@dataclass
class InputDecl:
    """`input name: type[?] [= default]`; its `-> target` part becomes a Flow. `optional`
    (`type?`): a request may leave it out, and the edges from it then end empty."""

    name: str
    type: str
    default: Value | None
    span: Span
    type_span: Span
    optional: bool = False


@dataclass
class Flow:
    """`source -> [map(...) ->] target [attrs]`: one edge, optionally through a map chain."""

    source: PortRef
    target: PortRef | OutputRef
    maps: list[MapOp]
    attrs: list[Attr]
    span: Span


@dataclass
class ConstraintDecl:
    """`colocate a, b, ...` or `separate a, b, ...`."""

    kind: str
    stages: list[tuple[str, Span]]
    span: Span


@dataclass
class Pipeline:
    """One `pipeline name { ... }` block, statements grouped by kind in source order."""

    name: str
    span: Span
    models: list[ModelDecl] = field(default_factory=list)
    params: list[ParamDecl] = field(default_factory=list)
    stages: list[StageDecl] = field(default_factory=list)
    inputs: list[InputDecl] = field(default_factory=list)
    flows: list[Flow] = field(default_factory=list)
    constraints: list[ConstraintDecl] = field(default_factory=list)

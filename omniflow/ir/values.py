"""Values that stage parameters and edge attributes hold besides plain literals.

`Param` is the one parameter reference from the parser through the IR into the plan: the
parser makes it (with the source span of `$name`), the build phase keeps it (without the
span, so graphs compare by meaning), and a plan's stage parameters carry it until each
request is admitted. In a plan it travels as a tagged JSON object, as do the two other
per-request references the lower phase adds: `StageSeed` (a stage's own stream of the
request's seed) and `InputRef` (the value of one of the request's inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from omniflow.errors import Span


@dataclass(frozen=True)
class Auto:
    """Let the compiler decide (e.g. `chunk=auto`)."""

    def __repr__(self) -> str:
        return "auto"


AUTO = Auto()


class Param(msgspec.Struct, frozen=True, tag="param", omit_defaults=True, eq=False):
    """`$name`: a reference to a pipeline parameter; a request may override its value.
    Equal by name: where the parser saw it (`span`) is not part of its meaning."""

    name: str
    span: Span | None = None

    def __eq__(self, other) -> bool:
        return isinstance(other, Param) and other.name == self.name

    def __hash__(self) -> int:
        return hash((Param, self.name))

    def __repr__(self) -> str:
        return f"${self.name}"


class StageSeed(msgspec.Struct, frozen=True, tag="seed"):
    """The seed of stage `stage`: its own stream of the request's seed."""

    stage: str


class InputRef(msgspec.Struct, frozen=True, tag="input"):
    """The value of the request's input `input` (a guidance companion)."""

    input: str


# What a plan's stage parameter may hold: a literal (a list holds literals), or a reference
# resolved per request.
PlanValue = bool | int | float | str | list | Param | StageSeed | InputRef | None


@dataclass(frozen=True)
class Ref:
    """A dotted name: an adapter, a Python function, or another node of the graph."""

    dotted: str

    def __repr__(self) -> str:
        return self.dotted


def format_value(value: object) -> str:
    """Render a value as `.omni` source text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return repr(value)


def resolve(value: object, params: dict[str, object]) -> object:
    """Replace `Param` references by their values in `params`."""
    if isinstance(value, Param):
        return params[value.name]
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v, params) for v in value)
    return value

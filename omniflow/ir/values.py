"""Values that stage parameters and edge attributes hold besides plain literals."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Auto:
    """Let the compiler decide (e.g. `chunk=auto`)."""

    def __repr__(self) -> str:
        return "auto"


AUTO = Auto()


@dataclass(frozen=True)
class Param:
    """A reference to a pipeline parameter; a request may override its value."""

    name: str

    def __repr__(self) -> str:
        return f"${self.name}"


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

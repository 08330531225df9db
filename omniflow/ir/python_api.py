"""The Python graph-building API: builds the same `ast.Pipeline` the parser produces.

Because it goes through the same build phase, a Python-built pipeline is checked exactly
like a `.omni` file, and its errors point at the caller's Python source line.
"""

from __future__ import annotations

import linecache
import sys

from omniflow.dsl import ast
from omniflow.errors import Span
from omniflow.ir.graph import Graph
from omniflow.ir.values import Param

# Attributes whose string values name something (an adapter, an input, a function).
_NAME_KEYS = frozenset({"adapter", "cfg", "fn"})


def param(name: str) -> Param:
    """A reference to a pipeline parameter, for stage arguments: `max_tokens=param("max_tokens")`."""
    return Param(name, _caller_span())


auto = ast.AUTO


def _caller_span() -> Span:
    frame = sys._getframe(1)
    while frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).rstrip("\n")
    col = len(text) - len(text.lstrip()) + 1
    return Span(frame.f_code.co_filename, frame.f_lineno, col, max(col + 1, len(text) + 1), text)


class _Handle:
    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, port: str) -> ast.PortRef:
        if port.startswith("_"):
            raise AttributeError(port)
        return ast.PortRef(self.name, port, _caller_span())


class Pipeline:
    """Build a pipeline in Python; `build()` returns the same Graph the `.omni` text would."""

    def __init__(self, name: str, model: str | None = None):
        self._ast = ast.Pipeline(name, _caller_span())
        if model is not None:
            self._ast.models.append(ast.ModelDecl(model, _caller_span()))

    def _attrs(self, kwargs: dict) -> list[ast.Attr]:
        span = _caller_span()
        return [ast.Attr(k, self._value(k, v), span, span) for k, v in kwargs.items()]

    @staticmethod
    def _value(key: str, value):
        if isinstance(value, _Handle):
            return ast.Name(value.name, _caller_span())
        if key in _NAME_KEYS and isinstance(value, str):
            return ast.Name(value, _caller_span())
        if value is True and key in ("stream", "whole"):
            return None
        return value

    def param(self, name: str, default) -> Param:
        span = _caller_span()
        self._ast.params.append(ast.ParamDecl(name, default, span))
        return Param(name, span)

    def stage(self, name: str, kind: str, device: str | None = None, **params) -> _Handle:
        span = _caller_span()
        self._ast.stages.append(
            ast.StageDecl(name, kind, self._attrs(params), device, span, span, span)
        )
        return _Handle(name)

    def input(self, name: str, type: str, default=None, optional: bool = False) -> _Handle:
        span = _caller_span()
        self._ast.inputs.append(ast.InputDecl(name, type, default, span, span, optional))
        return _Handle(name)

    def output(self, name: str) -> ast.OutputRef:
        return ast.OutputRef(name, _caller_span())

    def flow(self, source, target, maps=(), **attrs) -> None:
        """`source -> [map(...)] -> target [attrs]`; maps are names or (name, *args) tuples."""
        span = _caller_span()
        if isinstance(source, _Handle):
            source = ast.PortRef(source.name, None, span)
        if isinstance(target, _Handle):
            target = ast.PortRef(target.name, None, span)
        ops = [
            ast.MapOp(m, [], span) if isinstance(m, str) else ast.MapOp(m[0], list(m[1:]), span)
            for m in maps
        ]
        self._ast.flows.append(ast.Flow(source, target, ops, self._attrs(attrs), span))

    def colocate(self, *stages: _Handle) -> None:
        self._constraint("colocate", stages)

    def separate(self, *stages: _Handle) -> None:
        self._constraint("separate", stages)

    def _constraint(self, kind: str, stages) -> None:
        span = _caller_span()
        self._ast.constraints.append(
            ast.ConstraintDecl(kind, [(s.name, span) for s in stages], span)
        )

    def build(self) -> Graph:
        from omniflow.ir.from_ast import build

        return build(self._ast)

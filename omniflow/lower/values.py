"""IR values as plan data."""

from __future__ import annotations

from omniflow.ir.values import Auto, Param, Ref


def plain(value):
    """An IR value as plan data: a parameter reference stays one, a name becomes its text."""
    if isinstance(value, Param):
        return Param(value.name)
    if isinstance(value, Ref):
        return value.dotted
    if isinstance(value, Auto):
        return "auto"
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value

"""The `.omni` language: grammar, AST and parser (installed as `omniflow.dsl`)."""

from .parser import parse, parse_file

__all__ = ["parse", "parse_file"]

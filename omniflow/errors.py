"""The one error hierarchy: every error omniflow raises on purpose is an OmniflowError.

Errors that point into a `.omni` file carry a `Span` and print like a compiler's:
`path:line:col: error: message`, the source line, a caret under the span, and a hint.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A region of one source line (1-based line and columns; end_col is exclusive)."""

    path: str
    line: int
    col: int
    end_col: int
    line_text: str = ""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


class OmniflowError(Exception):
    """Base of every error omniflow raises deliberately."""


class SourceError(OmniflowError):
    """An error in a pipeline description, optionally located in `.omni` source."""

    def __init__(self, message: str, span: Span | None = None, hint: str | None = None):
        self.message = message
        self.span = span
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        if self.span is None:
            text = f"error: {self.message}"
        else:
            text = f"{self.span}: error: {self.message}"
            if self.span.line_text:
                width = max(1, self.span.end_col - self.span.col)
                text += f"\n  {self.span.line_text}\n  {' ' * (self.span.col - 1)}{'^' * width}"
        if self.hint:
            text += f"\nhint: {self.hint}"
        return text


class ParseError(SourceError):
    """The text is not valid `.omni` syntax."""


class GraphError(SourceError):
    """The program parses but does not describe a valid graph (names, types, cycles)."""


class LintError(OmniflowError):
    """A graph invariant is broken; the message names the offending node."""

    def __init__(self, node: str, message: str):
        self.node = node
        super().__init__(f"node '{node}': {message}")


class ModelConfigError(OmniflowError):
    """A model's configuration could not be found or understood."""


class UnknownComponent(ModelConfigError):
    """A model has no component of the name a stage gives."""


class PassError(OmniflowError):
    """A compiler pass failed; the message names the pass."""

    def __init__(self, pass_name: str, cause: BaseException):
        self.pass_name = pass_name
        self.cause = cause
        super().__init__(f"pass '{pass_name}' failed: {cause}")


class PlacementError(OmniflowError):
    """The pipeline cannot be placed on the given devices (names stage, need and supply)."""


class DeviceSpecError(OmniflowError):
    """A `--devices` inventory string could not be understood."""


class ChannelError(OmniflowError):
    """A data-plane channel failed: peer closed or died, timeout, or a payload bigger than its slot."""


class PayloadTooLarge(ChannelError):
    """One chunk does not fit its channel's slot: it fails that chunk's request, not the channel."""

"""Ready-made python stages: `stage s = python(fn=omniflow.runtime.builtin_stages.identity)`."""

from __future__ import annotations


def identity(call):
    """Streams its `in` port to its `out` port unchanged, chunk by chunk."""
    while (chunk := (yield from call.read("in"))) is not None:
        call.emit("out", chunk)
        yield

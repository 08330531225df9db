"""Robustness: mangled and truncated programs raise ParseError (or parse), quickly, and the
error always points at a real place in the text."""

import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniflow import dsl
from omniflow.errors import ParseError

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
EXAMPLES = [path.read_text(encoding="utf-8") for path in sorted(GRAPHS.glob("*.omni"))]
PER_INPUT_S = 1.0

# Characters and token-sized slices that the grammar cares about, plus some it rejects.
PIECES = list("{}()[]=-><:.,|@$\"\\#\n\t ;'0123456789aZ_+é→\x00\r") + [
    "->",
    "=>",
    "map(",
    "output ",
    "input ",
    "pipeline ",
    "stage ",
    "[[",
    '"',
    "1e999",
    "$x",
    "auto",
    "-1.5e-3",
]


def check(text: str) -> None:
    """Parse `text`: it may succeed or raise ParseError, within the time budget; the span
    of any error must name a real line and column of `text`."""
    start = time.perf_counter()
    try:
        result = dsl.parse(text, "fuzz.omni")
    except ParseError as error:
        span = error.span
        assert span is not None and span.path == "fuzz.omni"
        lines = text.split("\n")
        assert 1 <= span.line <= len(lines)
        assert span.line_text == lines[span.line - 1].removesuffix("\r")
        assert 1 <= span.col < span.end_col and span.col <= len(span.line_text) + 1
        assert error.render().startswith(f"fuzz.omni:{span.line}:{span.col}: error: ")
    else:
        assert isinstance(result, dsl.ast.Pipeline)
    assert time.perf_counter() - start < PER_INPUT_S


def mutate(text: str, op: str, where: float, size: int, piece: str, other: float) -> str:
    i = int(where * len(text))
    j = min(len(text), i + size)
    if op == "delete":
        return text[:i] + text[j:]
    if op == "insert":
        return text[:i] + piece + text[i:]
    if op == "replace":
        return text[:i] + piece + text[j:]
    if op == "duplicate":
        return text[:j] + text[i:j] + text[j:]
    if op == "truncate":
        return text[:i]
    lines = text.split("\n")  # swap two lines
    a, b = int(where * len(lines)), int(other * len(lines))
    lines[a], lines[b] = lines[b], lines[a]
    return "\n".join(lines)


mutations = st.tuples(
    st.sampled_from(["delete", "insert", "replace", "duplicate", "truncate", "swap"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(0, 8),
    st.sampled_from(PIECES),
    st.floats(0, 1, exclude_max=True),
)


@settings(
    max_examples=240,
    deadline=PER_INPUT_S * 1000,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.sampled_from(EXAMPLES), st.lists(mutations, min_size=1, max_size=4))
def test_mutated_examples_raise_only_parse_errors(text, steps):
    for step in steps:
        text = mutate(text, *step)
    check(text)


@settings(max_examples=60, deadline=PER_INPUT_S * 1000, derandomize=True)
@given(st.text(max_size=80))
def test_arbitrary_text_raises_only_parse_errors(junk):
    check(junk)
    check("pipeline p {\n" + junk)


def test_every_truncation_fails_cleanly():
    text = (GRAPHS / "omni_chat.omni").read_text(encoding="utf-8")
    end = text.rindex("}") + 1
    for cut in range(len(text) + 1):  # each within check's own time bound
        if cut >= end:
            assert isinstance(dsl.parse(text[:cut]), dsl.ast.Pipeline)
        else:
            check(text[:cut])

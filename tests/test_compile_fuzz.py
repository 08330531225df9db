"""Robustness of the whole compiler: programs mutated at the level of words and lines
(so most still parse) compile or fail with an OmniflowError — never another exception,
never a hang."""

import contextlib
import re
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniflow.compiler import compile_source
from omniflow.errors import OmniflowError
from omniflow.ir.kinds import EDGE_ATTRS, KINDS
from omniflow.kernels.pointwise_ops import OPS

EXAMPLES = [p.read_text() for p in sorted((Path(__file__).parents[1] / "graphs").glob("*.omni"))]
WORDS = sorted(
    set(re.findall(r"[A-Za-z_]\w*", "\n".join(EXAMPLES)))
    | set(KINDS)
    | set(EDGE_ATTRS)
    | set(OPS)
    | {p for k in KINDS.values() for p in (*k.inputs, *k.outputs, *k.params)}
)
NUMBERS = ["0", "1", "-1", "3", "25", "99999", "2.5", "1e9", "[]", "[0]", "auto", '"x"', "true"]
PER_PROGRAM_S = 2.0


def mutate(text: str, op: str, where: float, choice: int) -> str:
    lines = text.split("\n")
    i = int(where * len(lines))
    if op == "drop":
        del lines[i]
    elif op == "duplicate":
        lines.insert(i, lines[i])
    elif op == "swap":
        j = choice % len(lines)
        lines[i], lines[j] = lines[j], lines[i]
    else:
        pattern = r"[A-Za-z_]\w*" if op == "word" else r"-?\d+(\.\d+)?"
        spots = list(re.finditer(pattern, lines[i]))
        if spots:
            m = spots[choice % len(spots)]
            new = WORDS[choice % len(WORDS)] if op == "word" else NUMBERS[choice % len(NUMBERS)]
            lines[i] = lines[i][: m.start()] + new + lines[i][m.end() :]
    return "\n".join(lines)


mutations = st.tuples(
    st.sampled_from(["drop", "duplicate", "swap", "word", "word", "number", "number"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(0, 10_000),
)


@settings(
    max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
@given(st.sampled_from(EXAMPLES), st.lists(mutations, min_size=1, max_size=3))
def test_mutated_programs_compile_or_raise_omniflow_errors(text, steps):
    for step in steps:
        text = mutate(text, *step)
    start = time.perf_counter()
    with contextlib.suppress(OmniflowError):
        compile_source(text, "fuzz.omni", devices="2xH200")
    assert time.perf_counter() - start < PER_PROGRAM_S

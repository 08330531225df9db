"""Robustness of the whole compiler: programs mutated at the level of words and lines
(so most still parse), device inventories built from good and bad pieces, and parameter
defaults swapped for huge, negative, fractional or mistyped values all compile or fail
with an OmniflowError — never another exception, never a hang."""

import contextlib
import re
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omniflow.compiler import compile_source
from omniflow.devices import ACCELERATORS
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
# Generous: a case that hangs runs for minutes; this only has to tell one from a slow machine.
PER_CASE_S = 5.0
FUZZ = settings(
    max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


def assert_compiles_or_raises_omniflow_error(text: str, devices: str = "2xH200") -> None:
    start = time.perf_counter()
    with contextlib.suppress(OmniflowError):
        compile_source(text, "fuzz.omni", devices=devices)
    assert time.perf_counter() - start < PER_CASE_S


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


@FUZZ
@given(st.sampled_from(EXAMPLES), st.lists(mutations, min_size=1, max_size=3))
def test_mutated_programs_compile_or_raise_omniflow_errors(text, steps):
    for step in steps:
        text = mutate(text, *step)
    assert_compiles_or_raises_omniflow_error(text)


# --- device inventories --------------------------------------------------------------

COUNTS = ["1", "2", "8", "64", "007", "0", "-1", "+3", "65", "1024", "1000000", "9" * 40]
MODELS = [*ACCELERATORS, "h100", "a100-40g", "TPU", "cpu", ""]
INDEXES = ["0", "1", "7", "1023", "1024", "99999999", "9" * 40, "-1", ""]
SIZES = ["", "=80GiB", "=512MiB", "=1.5TB", "=16", "=64TiB"]
SIZES += ["=0", "=0.5MiB", "=65TiB", "=1e300GiB", "=nan", "=inf", "=-8GiB", "=1.2.3", "="]
SIZES += ["=" + "9" * 400]

entries = st.one_of(
    st.builds("{}x{}{}".format, *map(st.sampled_from, (COUNTS, MODELS, SIZES))),
    st.builds("cuda:{}{}".format, st.sampled_from(INDEXES), st.sampled_from(SIZES)),
    st.builds("{}{}".format, st.sampled_from(["cpu", "cuda"]), st.sampled_from(SIZES)),
    st.text(max_size=12),  # junk
)
inventories = st.one_of(
    st.builds(str.join, st.sampled_from([",", " , ", ",,"]), st.lists(entries, max_size=6)),
    # Around the bound on the number of devices, and past it.
    st.integers(1, 20).map(lambda n: ",".join(["64xH200"] * n)),
)


@settings(FUZZ, max_examples=300)
@given(st.sampled_from(EXAMPLES), inventories)
def test_any_inventory_compiles_or_raises_omniflow_errors(text, devices):
    assert_compiles_or_raises_omniflow_error(text, devices)


# --- parameter values ----------------------------------------------------------------

PARAM_DEFAULT = re.compile(r"^(\s*param\s+\w+\s*=\s*)(.*)$")
VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1", "0.5", "-0.5", "1e9", "1e308", "-1e308", "1e-300"]),
    st.sampled_from(["9" * 30, "-" + "9" * 30, '"x"', '""', '"2048"', "true", "auto", "[]"]),
    st.sampled_from(["[1, 2]", "nan", "inf", "$max_tokens"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    # Plausible sizes, up to and past the bounds on lengths: these reach the passes.
    st.integers(1, 1 << 21).map(str),
    st.sampled_from(["16", "4096", "16384", "1048576", "1048577"]),
)


def with_param_defaults(text: str, changes: list[tuple[int, str]]) -> str:
    """`text` with the default of its (which % count)-th `param` set to each value."""
    lines = text.split("\n")
    params = [i for i, line in enumerate(lines) if PARAM_DEFAULT.match(line)]
    for which, value in changes:
        i = params[which % len(params)]
        lines[i] = PARAM_DEFAULT.sub(lambda m, v=value: m.group(1) + v, lines[i])
    return "\n".join(lines)


@settings(FUZZ, max_examples=300)
@given(
    st.sampled_from(EXAMPLES),
    st.lists(st.tuples(st.integers(0, 100), VALUES), min_size=1, max_size=3),
)
def test_any_parameter_default_compiles_or_raises_omniflow_errors(text, changes):
    assert_compiles_or_raises_omniflow_error(with_param_defaults(text, changes))

"""The sampling knobs of autoregressive stages, and their domains: one table that the `ar`
kind's parameters (`omniflow.ir.kinds`), admission (`omniflow.runtime.requests`) and every
`ar` backend (`omniflow.backends.sampling_params`) check values against, so a value a
backend would refuse is a 400 at admission, with the same words.

Each knob has a neutral value (what sampling does when neither the request, the program nor
the model's generation config sets it) and a domain: a closed or open interval, and values
outside it that still mean something (`top_k` -1 or 0: no limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    """A sampling knob: its type, neutral value and domain (`low`/`high`, each inclusive
    unless `*_open`; `also`: values allowed outside the interval). `rule` says the domain
    in words."""

    name: str
    types: tuple[type, ...]
    neutral: float | int
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: tuple[int | float, ...] = ()

    @property
    def rule(self) -> str:
        if math.isinf(self.high):
            interval = f"{'>' if self.low_open else '>='} {self.low:g}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            interval = f"in {left}{self.low:g}, {self.high:g}{right}"
        return " or ".join([*(f"{v:g}" for v in self.also), interval])

    def allows(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, self.types):
            return False
        if value in self.also:
            return True
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def problem(self, value) -> str | None:
        """None if `value` is in the domain, else what is wrong with it."""
        shown = f"{value:g}" if isinstance(value, (int, float)) else repr(value)
        return None if self.allows(value) else f"{self.name} {shown} ({self.rule})"


_FLOAT = (float, int)
KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("temperature", _FLOAT, 1.0, low=0, high=100),
        Knob("top_p", _FLOAT, 1.0, low=0, high=1, low_open=True),
        Knob("top_k", (int,), -1, low=1, also=(-1, 0)),
        # (from 0.01: a smaller one divides the logits past float32, and the draw fails)
        Knob("repetition_penalty", _FLOAT, 1.0, low=0.01, high=100),
        Knob("max_tokens", (int,), 2048, low=1),
    )
}


def problems(values: dict) -> list[str]:
    """What is wrong with each knob `values` sets (unknown keys are not knobs: ignored)."""
    return [p for name, v in values.items() if name in KNOBS and (p := KNOBS[name].problem(v))]

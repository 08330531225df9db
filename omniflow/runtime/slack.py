"""Playback slack: how long a stream's listener can keep playing what it was sent, and what
the stages that make its audio do with it.

A listener who started playing at the stream's first packet runs dry at `runs_out`: the
first packet's time plus the seconds of audio sent since (`plays_s` a step). The stages
that make audio put the stream that runs dry first first:

- an `ar` stage whose steps become audio (a talker that makes one codec frame a step) and
  a vocoder order the requests they step by it when rows contend -- a full batch, or
  requests waiting to start -- (`urgent_first`); a request that has sent nothing yet is
  the most urgent, the earliest first;
- the writer of an edge into a vocoder that carries its state cuts the edge's chunks: its
  schedule (1, 2, 4, ... frames) widens only while the stream is ahead of its listener,
  and a chunk that would keep the listener waiting goes out short (`cut_short`).

Without a known duration a step (text, or a codec of unknown rate) every stream counts as
having sent nothing: arrival order, the schedule as planned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Playback:
    """One stream's sending, as its listener hears it: when it opened, when its first packet
    left (None: not yet) and the steps sent since (each `plays_s` seconds of audio)."""

    opened: float
    first_sent: float | None = None
    sent: int = 0

    def send(self, steps: int, now: float) -> None:
        if self.first_sent is None:
            self.first_sent = now
        self.sent += steps

    def runs_out(self, plays_s: float | None) -> float:
        """When the listener has played all it was sent (monotonic seconds); before the
        first packet, or without a step's duration, when the stream opened."""
        if self.first_sent is None or plays_s is None:
            return self.opened
        return self.first_sent + self.sent * plays_s


def urgent_first(items: Sequence[T], runs_out: Callable[[T], float]) -> list[T]:
    """`items` in the order their listeners run dry, ties (and every item, without slack)
    in the order given: arrival order."""
    return sorted(items, key=runs_out)  # (a stable sort)


@dataclass
class StepTimer:
    """How long a producer takes per step, from the steps it hands over and when: a running
    mean that halves the weight of older intervals."""

    last: float | None = None
    step_s: float | None = None

    def add(self, steps: int, now: float) -> None:
        if self.last is not None and steps:
            interval = (now - self.last) / steps
            self.step_s = interval if self.step_s is None else (self.step_s + interval) / 2
        self.last = now


def cut_short(slack_s: float, missing: int, step_s: float | None) -> bool:
    """Whether a chunk still `missing` steps, made one every `step_s` seconds (None: not
    known yet), should go out with what it has: its listener, `slack_s` seconds from running
    dry, would run dry waiting for the rest."""
    return step_s is not None and missing * step_s >= slack_s

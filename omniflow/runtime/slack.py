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
  and a chunk that would keep the listener waiting goes out short (`cut_short`);
- a request's first packet goes first: while one is on the device in a stage of a program
  (a prefill's first frame, a vocoder's first window), the program's audio stages launch
  nothing for the streams that can wait (`can_wait`: their listeners have HOLD_S of audio
  left; or a talker's row whose own first frame is on its way), so the first packet has
  the GPU to itself, within a share of the time (`HoldBudget`: under load first packets
  come nearly always). On one GPU a vocoder's first window beside the talker's next frames
  took 4.9 ms where alone it takes 3.1 (docs/benchmarks-log.md, "Qwen3-Omni's thinker at
  full depth, ..."); the frames it waits for are needed only once the first packet has
  played;
- a request's own makers wait for its window on the device (`makers_can_wait`): a vocoder's
  first window always (its listener has not started, and the frames after the window are
  needed only once it plays), a later one where the listener would otherwise be played
  out before it and can spare the pause (but for a carried-state stream, which its edge
  keeps fed by cutting chunks short). Only that request's rows wait, outside the
  `HoldBudget`, and only where their stage would then launch nothing (a batched step that
  runs for other rows costs no more with them). Omni chat's token2wav window beside its
  own thinker's and talker's steps took 168 ms on an H100 where alone it takes 43; with
  the makers waiting its first packet came at 247 ms, not 362, with no gap
  (docs/benchmarks-log.md, "A request's own makers wait for its window, ...").

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


# The audio a stream's listener must have left for its next step to wait for another
# request's first packet. A stream with less steps at once: 40 ms covers its next packet's
# making once it does (a talker frame and a code2wav window at batch 64 take ~6 and ~13 ms
# on an H100); and it is below one Qwen3-TTS frame (80 ms), so that a stream one frame in
# lets the first packets by.
HOLD_S = 0.04


def can_wait(runs_out: float, now: float) -> bool:
    """Whether a stream whose listener runs dry at `runs_out` can let a first packet by."""
    return runs_out - now > HOLD_S


# First packets hold the running streams back for at most this share of the time, from a
# bucket of at most HOLD_SPELL_S (a spell lasts HOLD_SPELL_S / (1 - HOLD_SHARE), ~24 ms, at
# most): at one request a first packet (a prefill's first frame and a vocoder's first
# window, ~10 ms) holds them alone; under load, where a first packet is on the device nearly
# always (64 streams of 5 s open ~60 a second), the running streams still have the GPU 85 %
# of the time, not only the 40 ms before their listeners run dry.
HOLD_SHARE = 0.15
HOLD_SPELL_S = 0.02


@dataclass
class HoldBudget:
    """A program's time for first packets to hold its running streams back: a bucket of at
    most HOLD_SPELL_S seconds that fills at HOLD_SHARE of the time and empties while held."""

    left: float = HOLD_SPELL_S
    last: float | None = None
    holding: bool = False

    def hold(self, wanted: bool, now: float) -> bool:
        """Whether to hold now, where a first packet on the device `wanted` it."""
        if self.last is not None:
            elapsed = now - self.last
            spent = elapsed if self.holding else 0.0
            self.left = min(HOLD_SPELL_S, self.left + elapsed * HOLD_SHARE - spent)
        self.last = now
        self.holding = wanted and self.left > 0
        return self.holding


def cut_short(slack_s: float, missing: int, step_s: float | None) -> bool:
    """Whether a chunk still `missing` steps, made one every `step_s` seconds (None: not
    known yet), should go out with what it has: its listener, `slack_s` seconds from running
    dry, would run dry waiting for the rest."""
    return step_s is not None and missing * step_s >= slack_s


def makers_can_wait(
    runs_out: float,
    window_s: float,
    runs_out_after: float,
    now: float,
    missing: int,
    step_s: float | None,
) -> bool:
    """Whether the makers of a stream whose window (of `window_s` seconds of audio) is on
    the device should pause until it has left: its listener, who runs dry at `runs_out`,
    would be played out before the window's audio could play through (a stream a window
    ahead needs no hold), and once its audio is sent (dry at `runs_out_after`) keeps more
    than HOLD_S as the next window's `missing` frames are made, one every `step_s` seconds
    (None: the pace is not known yet, no pause)."""
    if step_s is None or runs_out - now >= window_s:
        return False
    return runs_out_after - now - missing * step_s > HOLD_S

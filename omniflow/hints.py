"""Hints for error messages: the known name closest to a mistyped one.

The build phase, the model catalog and the tiny-checkpoint builders all answer an unknown
name with the same `did you mean '...'?`, from here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[object], ignore_case: bool = False) -> str | None:
    """`did you mean 'X'?` for the choice closest to `name`, or None when none is close.

    `ignore_case` matches model ids the way the hub does, and names the choice as spelled.
    """
    spelled = {str(c).lower() if ignore_case else str(c): str(c) for c in choices}
    close = difflib.get_close_matches(name.lower() if ignore_case else name, list(spelled), n=1)
    return f"did you mean '{spelled[close[0]]}'?" if close else None


def one_of(choices: Iterable[object]) -> str:
    """The choices, comma-separated."""
    return ", ".join(str(c) for c in choices)


def suggest(name: str, choices: Iterable[object], label: str) -> str:
    """The closest choice to `name` if one is close, else every choice under `label`."""
    choices = list(choices)
    return did_you_mean(name, choices) or f"{label}: {one_of(choices)}"

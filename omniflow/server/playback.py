"""Playback continuity: how long a listener who starts playing a stream's audio when its
first packet arrives waits for later packets (its underrun), the service level of a speech
stream. The server measures it per streamed reply (`/metrics`, `--log-stats`), and load
benchmarks measure it the same way on the client's side of the wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Playback:
    """A listener fed packets as they arrive: `played_until` is when the audio it holds runs
    out (clock seconds), `underrun` the seconds it has waited with none to play."""

    played_until: float | None = None
    underrun: float = 0.0

    def arrived(self, now: float, seconds: float) -> None:
        """A packet of `seconds` of audio arrived at clock time `now`."""
        if self.played_until is None:
            self.played_until = now
        elif now > self.played_until:
            self.underrun += now - self.played_until
            self.played_until = now
        self.played_until += seconds

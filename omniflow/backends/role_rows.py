"""A talker's conditioning rows streamed from its thinker, whose role (prompt or reply) each
row carries on the device: the roles read back to the host without waiting.

A thinker sends its prompt's rows and then a row a reply token down one stream, and the
chunks that arrive need not end where the prompt does, so each row carries its role in one
of its own elements. The talker needs those roles on the host (where its prompt ends). Read
at once they would be a host sync a thinker token: the loop would wait for everything queued
on the stage's stream (the talker's steps in flight) and the thinker's step that made the
row, stalling every stage of the process (docs/architecture.md, "One GPU, one process").
So `RoleRows.arrive` keeps a chunk with a copy of its roles under way
(`omniflow.runtime.readback`), and `take` hands out a request's chunks, in arrival order,
once their roles have landed; until then the request's stream counts as not yet ended
(`ended`) and the backend stays in flight (`in_flight`), so the loop keeps polling. Off CUDA
the roles are already on the host: a chunk is taken in the turn it arrives.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Iterator

import torch

from omniflow.runtime.readback import HostCopy, to_host
from omniflow.runtime.stage import Call


class _Arriving:
    """One request's chunks whose roles are on their way, oldest first."""

    def __init__(self, call: Call):
        self.call = weakref.ref(call)
        self.chunks: deque[tuple[torch.Tensor, HostCopy]] = deque()

    def waited_for(self) -> bool:
        """Whether chunks are on their way for a request still running (a finished or
        failed one takes no more: its chunks keep no loop polling)."""
        call = self.call()
        return bool(self.chunks) and call is not None and call.running

    def landed(self) -> bool:
        return bool(self.chunks) and self.chunks[0][1].landed()


class RoleRows:
    """The chunks of rows a talker takes off its input `port`, each row's role picked by
    `roles` (`[n, ...]` rows -> `[n]` roles on the device)."""

    def __init__(self, port: str, roles: Callable[[torch.Tensor], torch.Tensor]):
        self.port = port
        self.roles = roles
        self.key = f"role_rows:{port}"  # the request's chunks on their way, in its state
        # Every request's chunks on their way; a request's go with its state when it leaves.
        self.live: weakref.WeakSet[_Arriving] = weakref.WeakSet()

    def _arriving(self, call: Call) -> _Arriving:
        arriving = call.state.get(self.key)
        if arriving is None:
            arriving = call.state[self.key] = _Arriving(call)
            self.live.add(arriving)
        return arriving

    def arrive(self, call: Call, rows: torch.Tensor) -> None:
        """Keep `rows` (the caller's own copy) while their roles come to the host."""
        roles = to_host(self.roles(rows))
        self._arriving(call).chunks.append((rows, roles))

    def available(self, call: Call) -> bool:
        """Whether the request has a chunk to take: arrived on the port or landed here."""
        arriving = call.state.get(self.key)
        return call.inputs[self.port].available() or (arriving is not None and arriving.landed())

    def take(self, call: Call) -> Iterator[tuple[torch.Tensor, list[float]]]:
        """The request's chunks whose roles have landed, each with its rows' roles."""
        arriving = call.state.get(self.key)
        while arriving is not None and arriving.landed():
            rows, roles = arriving.chunks.popleft()
            yield rows, roles.value.tolist()

    def ended(self, call: Call) -> bool:
        """Whether the request's stream has ended and every chunk of it has been taken."""
        arriving = call.state.get(self.key)
        port = call.inputs[self.port]
        untaken = port.available() or (arriving is not None and bool(arriving.chunks))
        return port.ended and not untaken

    def in_flight(self) -> bool:
        """Whether some request's chunk waits for its roles to land."""
        return any(arriving.waited_for() for arriving in list(self.live))

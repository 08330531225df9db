"""How a loop sleeps and is woken: an eventfd per loop that anyone with work for it pokes,
and one poll over that, its channels' doorbells and its control socket."""

from __future__ import annotations

import contextlib
import os
import select
import threading


class Waker:
    """An eventfd a loop polls; anything that has work for the loop pokes it. Pokes come
    from other threads, which may poke a loop that has just ended: a poke after `close` does
    nothing (the lock keeps it from writing to a number the process has since reused)."""

    def __init__(self):
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._lock = threading.Lock()
        self._closed = False

    def poke(self) -> None:
        with self._lock:
            if not self._closed:
                os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self.fd)


def wait(fds: list[tuple[int, int]], timeout_s: float) -> set[int]:
    """Block until one of (fd, events) is ready, or `timeout_s` passes; the fds that are ready."""
    poller = select.poll()
    for fd, events in fds:
        poller.register(fd, events)
    return {fd for fd, _events in poller.poll(max(0, int(timeout_s * 1000)))}

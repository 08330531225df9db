"""A loop's waker: a poke wakes its poll; a poke that comes after the loop has closed it
(another thread finishing late, say an engine closed while its I/O thread shuts down) does
nothing, not even to a file that has since taken the eventfd's number."""

import os
import select

import pytest

from omniflow.runtime.wakeup import Waker, wait


def test_a_poke_wakes_the_poll_until_drained():
    waker = Waker()
    try:
        assert wait([(waker.fd, select.POLLIN)], 0) == set()
        waker.poke()
        assert wait([(waker.fd, select.POLLIN)], 0) == {waker.fd}
        waker.drain()
        assert wait([(waker.fd, select.POLLIN)], 0) == set()
    finally:
        waker.close()


def test_a_poke_after_close_writes_nothing_anywhere():
    waker = Waker()
    waker.close()
    read, write = os.pipe()  # the lowest free numbers: the eventfd's, unless a thread took it
    os.set_blocking(read, False)
    try:
        waker.poke()  # unguarded: EBADF, or 8 bytes into whatever holds the number now
        waker.close()
        with pytest.raises(BlockingIOError):
            os.read(read, 8)
    finally:
        os.close(read)
        os.close(write)

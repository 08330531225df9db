"""The admission queue of one served pipeline: a request beyond the limit waits for a slot,
first come first served; a full queue, or a wait past its bound, is a 503 with Retry-After;
a waiter that goes away leaves the queue and takes no slot."""

import asyncio
from pathlib import Path

import pytest

from omniflow.compiler import compile_file
from omniflow.server.errors import APIError
from omniflow.server.metrics import Metrics
from omniflow.server.served import Served

PLAN = compile_file(Path(__file__).parent / "probe.omni")


def served(limit=2, max_queue=2, max_wait_s=5.0) -> Served:
    return Served("p", PLAN, None, limit, Metrics(), max_queue=max_queue, max_wait_s=max_wait_s)


def test_requests_beyond_the_limit_wait_their_turn_in_order():
    async def scenario():
        pipe, order = served(), []
        held = [await pipe.acquire(), await pipe.acquire()]

        async def later(name):
            slot = await pipe.acquire()
            order.append(name)
            return slot

        waiters = [asyncio.create_task(later(n)) for n in ("first", "second")]
        await asyncio.sleep(0.01)
        assert pipe.inflight == 2 and len(pipe.waiting) == 2 and order == []
        held.pop().release()
        await asyncio.sleep(0.01)
        assert order == ["first"]
        held.pop().release()
        await asyncio.sleep(0.01)
        assert order == ["first", "second"] and pipe.inflight == 2 and not pipe.waiting
        for task in waiters:
            (await task).release()
        assert pipe.inflight == 0

    asyncio.run(scenario())


def test_a_full_queue_refuses_at_once_with_retry_after():
    async def scenario():
        pipe = served(limit=1, max_queue=1)
        slot = await pipe.acquire()
        waiter = asyncio.create_task(pipe.acquire())
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as info:
            await pipe.acquire()
        assert info.value.status == 503 and info.value.headers.get("Retry-After")
        slot.release()
        (await waiter).release()

    asyncio.run(scenario())


def test_a_wait_past_its_bound_is_a_503_and_leaves_the_queue():
    async def scenario():
        pipe = served(limit=1, max_queue=4, max_wait_s=0.05)
        slot = await pipe.acquire()
        with pytest.raises(APIError) as info:
            await pipe.acquire()
        assert info.value.status == 503 and "no free slot for 0.05 s" in info.value.message
        assert not pipe.waiting and pipe.inflight == 1
        slot.release()

    asyncio.run(scenario())


def test_a_waiter_that_goes_away_takes_no_slot():
    async def scenario():
        pipe = served(limit=1)
        slot = await pipe.acquire()
        gone = asyncio.create_task(pipe.acquire())
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert not pipe.waiting
        slot.release()
        assert pipe.inflight == 0

    asyncio.run(scenario())


def test_more_slots_than_the_pipeline_has_are_refused_not_queued_for_ever():
    async def scenario():
        pipe = served(limit=2)
        for count in (3, 0):
            with pytest.raises(ValueError, match=f"{count} slots asked of pipeline 'p'"):
                await pipe.acquire(count)
        assert not pipe.waiting and pipe.inflight == 0
        (await pipe.acquire(2)).release()

    asyncio.run(scenario())

"""The runtime under stress: stage exceptions, killed executors, cancellation,
backpressure, and shutdown — none may hang, lose other requests, or leak shared memory."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from omniflow.compiler import compile_source
from omniflow.errors import OmniflowError
from omniflow.plan import Plan
from omniflow.runtime import shm_ring
from omniflow.runtime.engine import Engine, RequestCancelled, RequestFailed
from omniflow.runtime.shm_ring import SHM_DIR

ROOT = Path(__file__).parents[2]

CHAIN = """pipeline chain {{
  stage src = python(fn=tests.runtime.stages.counter, inputs="n:text", outputs="out:tokens", max_batch={batch})
  stage dst = python(fn=tests.runtime.stages.double, inputs="in:tokens", outputs="out:tokens", max_batch={batch})
  input n: text -> src
  src.out -> dst [stream, chunk={chunk}, credits={credits}]
  dst.out -> output out [stream]
}}"""


def chain(chunk=8, credits=2, batch=4):
    return compile_source(CHAIN.format(chunk=chunk, credits=credits, batch=batch), "chain.omni")


def segments() -> set[str]:
    return set(shm_ring.segments())


def _ours_or_orphaned(segment: str) -> bool:
    """Whether this test process (or a child of it) made the segment, or its maker is gone
    and nobody will unlink it; segments of other live processes on the machine are theirs."""
    pid = shm_ring.segment_creator(segment)
    if pid == os.getpid():
        return True
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return True
    return parent == os.getpid()


def _bytes_of(names) -> int:
    return sum((SHM_DIR / name).stat().st_size for name in names)


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves any omniflow shared-memory segment behind."""
    before = segments()

    def leaked() -> set[str]:
        return {s for s in segments() - before if _ours_or_orphaned(s)}

    yield
    deadline = time.monotonic() + 5
    while leaked() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leaked() == set()


def interruptible() -> None:
    """A child's Ctrl-C as a terminal gives it (`preexec_fn`): a suite started in the
    background by a non-interactive shell inherits SIGINT ignored, and Python then never
    raises KeyboardInterrupt in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`proc.communicate(timeout)`; a process still running then is killed (its executors
    follow it) before the timeout fails the test, so that it leaves nothing running."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def wait_until(condition, timeout=30.0):  # generous, for a loaded machine
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_failing_stage_fails_only_its_request(no_leaks):
    plan = compile_source(
        """pipeline p {
          stage up = python(fn=tests.runtime.stages.fail_on_boom, inputs="in:text", outputs="out:text")
          input prompt: text -> up
          up.out -> output out
        }""",
        "p.omni",
    )
    with Engine(plan, "process") as engine:
        results, errors = {}, {}

        def run(text):
            try:
                results[text] = engine.generate({"prompt": text})["out"]
            except RequestFailed as err:
                errors[text] = str(err)

        threads = [
            threading.Thread(target=run, args=(t,)) for t in ("fine", "boom now", "also fine")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert results == {"fine": "FINE", "also fine": "ALSO FINE"}, errors
    assert errors["boom now"] == "stage 'up' failed: ValueError: boom in 'boom now'"


def kill_mid_stream(engine: Engine, executor: str) -> tuple[int, str]:
    """Kill `executor` while a request streams through it; its pid and the request's error,
    which must come within 2 s."""
    stream = engine.stream_sync({"n": "400"})
    next(stream)  # the request is streaming
    killed = engine.executor_pids[executor]
    os.kill(killed, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RequestFailed) as info:
        for _ in stream:
            pass
    assert time.monotonic() - start < 2.0
    return killed, str(info.value)


def test_killed_executor_fails_its_requests_fast_restarts_and_leaks_nothing(no_leaks, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.01")
    with Engine(chain(), "process") as engine:
        killed, error = kill_mid_stream(engine, "dst")
        assert "executor 'dst' (stages dst) died" in error
        monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0")
        out = engine.generate({"n": "20"})["out"]
        assert out.flatten().tolist() == [2 * i for i in range(20)]
        assert engine.executor_pids["dst"] != killed


def test_an_executor_prints_its_threads_stacks_on_sigusr1_and_serves_on(no_leaks):
    """`kill -USR1` an executor: every thread's stack goes to its log (how a stalled one is
    looked at), and it goes on serving."""
    with Engine(chain(), "process") as engine:
        transport = engine._core.transport
        os.kill(engine.executor_pids["dst"], signal.SIGUSR1)
        # The dump is written line by line: wait for the loop's own frame, not its first line.
        wait_until(lambda: "in serve" in transport.log_tail("dst", 200))
        assert "Thread 0x" in transport.log_tail("dst", 200)
        out = engine.generate({"n": "20"})["out"]
        assert out.flatten().tolist() == [2 * i for i in range(20)]


def one_gpu(source: str) -> Plan:
    """`source` compiled for one GPU, where the executor rule puts every stage in one
    process. The plan runs here without that GPU (stand-ins for model stages; these python
    stages run their own functions), as a GPU plan runs on a CPU machine."""
    return compile_source(source, "one_gpu.omni", devices="1xH200")


def test_an_executor_of_several_stages_killed_mid_stream_fails_all_their_requests_and_restarts(
    no_leaks, monkeypatch
):
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.01")
    plan = one_gpu(CHAIN.format(chunk=8, credits=2, batch=4))
    (executor,) = plan.executors
    assert executor.stage_names == ["src", "dst"]
    with Engine(plan, "process", backends="standin") as engine:
        streams = [engine.stream_sync({"n": "400"}) for _ in range(3)]
        for stream in streams:
            next(stream)  # every request streams through both stages
        killed = engine.executor_pids[executor.name]
        os.kill(killed, signal.SIGKILL)
        start = time.monotonic()
        for stream in streams:
            with pytest.raises(RequestFailed) as info:
                for _ in stream:
                    pass
            assert "executor 'src+dst' (stages src, dst) died" in str(info.value)
        assert time.monotonic() - start < 2.0
        monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0")
        out = engine.generate({"n": "20"})["out"]  # both stages are back
        assert out.flatten().tolist() == [2 * i for i in range(20)]
        assert engine.executor_pids[executor.name] != killed


TWO_TEXT_STAGES = """pipeline p {
  stage up = python(fn=tests.runtime.stages.FN, inputs="in:text", outputs="out:text")
  stage again = python(fn=tests.runtime.stages.FN, inputs="in:text", outputs="out:text")
  input prompt: text -> up
  up.out -> again
  again.out -> output out
}"""


def two_text_stages_on_one_gpu(fn: str) -> Plan:
    """Two text stages running `fn` (of tests/runtime/stages.py), one after the other, in the
    one executor of one GPU."""
    return one_gpu(TWO_TEXT_STAGES.replace("FN", fn))


def test_a_stage_that_raises_fails_its_own_requests_and_spares_the_stages_beside_it(no_leaks):
    plan = two_text_stages_on_one_gpu("fail_on_boom")
    (executor,) = plan.executors
    with Engine(plan, "process", backends="standin") as engine:
        pids = engine.executor_pids
        with pytest.raises(RequestFailed, match="stage 'up' failed: ValueError: boom"):
            engine.generate({"prompt": "boom now"})
        assert engine.generate({"prompt": "fine"})["out"] == "FINE"  # through both stages
        assert engine.executor_pids == pids  # the executor lives on
    assert executor.stage_names == ["up", "again"]


def cancel_mid_stream(engine: Engine) -> None:
    """Cancel a request while it streams; it ends with RequestCancelled."""
    stream = engine.stream_sync({"n": "2000"}, request_id="victim")
    next(stream)
    engine.cancel("victim")
    with pytest.raises(RequestCancelled):
        for _ in stream:
            pass


def test_cancel_reaches_every_stage_and_empties_the_rings(no_leaks, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.005")
    with Engine(chain(), "process") as engine:
        cancel_mid_stream(engine)

        def idle():
            state = engine.inspect()
            return all(
                not any(i.calls.values()) and i.held_slots == 0 and i.queued_chunks == 0
                for i in state.values()
            )

        wait_until(idle)
        assert engine.generate({"n": "5"})["out"].flatten().tolist() == [0, 2, 4, 6, 8]


def test_a_stream_submitted_and_closed_unread_cancels_its_request(monkeypatch):
    """`submit_stream` submits at once (a server submits each request as it admits it);
    closing the stream before reading a chunk ends the request in every stage."""
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.005")
    with Engine(chain(), "process") as engine:

        def idle() -> bool:
            return all(not any(i.calls.values()) for i in engine.inspect().values())

        async def submit_and_close() -> None:
            chunks = engine.submit_stream({"n": "100000"})  # (minutes, unless cancelled)
            await asyncio.sleep(0.5)
            assert chunks.items.qsize() > 0  # it ran before anything read it
            await chunks.aclose()
            with pytest.raises(StopAsyncIteration):
                await chunks.__anext__()

        asyncio.run(submit_and_close())  # (its loop closed: the cancellation's word is lost)
        wait_until(idle)
        assert engine.generate({"n": "3"})["out"].flatten().tolist() == [0, 2, 4]


def test_backpressure_bounds_memory_and_loses_nothing(no_leaks, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.0002")
    plan = chain(chunk=8, credits=2, batch=1)
    ring = next(c for c in plan.channels if c.name == "src.out->dst.in")
    with Engine(plan, "process") as engine:
        shm_bytes = _bytes_of(s for s in segments() if _ours_or_orphaned(s))
        peak_queue = 0
        stream = engine.stream_sync({"n": "3000"})
        values = []
        for i, chunk in enumerate(stream):
            if chunk.value is not None:
                values += chunk.value.flatten().tolist()
            if i % 50 == 0:
                peak_queue = max(
                    peak_queue, max(x.queued_chunks for x in engine.inspect().values())
                )
                assert _bytes_of(s for s in segments() if _ours_or_orphaned(s)) == shm_bytes
    assert values == [2 * i for i in range(3000)]
    assert ring.slots == 2
    # A stage stops while a ring it feeds lacks credit, so at most one step's output waits:
    # dst takes in at most its ring's slots of 8-step chunks per step, and sends one-step
    # chunks to the client.
    assert peak_queue <= ring.slots * 8


SCRIPT = """
import sys, time
sys.path.append({root!r})  # its python stages are the tests' (run with -P: see conftest.py)
from omniflow.compiler import compile_source
from omniflow.runtime.engine import Engine
plan = compile_source({source!r}, "chain.omni")
engine = Engine(plan, "process")
print("ready", *engine.executor_pids.values(), flush=True)
try:
    while True:
        time.sleep(0.1)
finally:
    engine.close()
"""


@pytest.mark.parametrize(
    "how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["term", "int", "kill"]
)
def test_engine_process_ending_leaves_no_segment_and_no_executor(how, no_leaks):
    source = CHAIN.format(chunk=8, credits=2, batch=2)
    script = textwrap.dedent(SCRIPT.format(source=source, root=str(ROOT)))
    proc = subprocess.Popen(
        [sys.executable, "-P", "-c", script],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    words = proc.stdout.readline().split()
    assert words[0] == "ready"
    children = [int(w) for w in words[1:]]
    proc.send_signal(how)
    # Generous: executors wind down (up to 10 s each before a kill) on a machine that may be
    # running other suites; a hang still fails.
    finish(proc, timeout=60)
    wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), timeout=10)
    if how == signal.SIGKILL:
        # The killed engine cannot unlink its own rings; the janitor (run by every engine
        # start, as here) removes what dead processes left.
        from omniflow.runtime.shm_ring import cleanup_stale_segments

        cleanup_stale_segments()


def test_downstream_starts_on_the_first_chunk_and_short_requests_overtake_long_ones(monkeypatch):
    monkeypatch.setenv("OMNIFLOW_TEST_DELAY", "0.02")
    with Engine(chain(chunk=8), "process") as engine:
        start = time.monotonic()
        long_stream = engine.stream_sync({"n": "40"})  # 40 steps x 20 ms upstream
        first = next(long_stream)
        first_at = time.monotonic() - start
        short = engine.generate({"n": "3"})  # submitted while the long one streams
        short_done_at = time.monotonic() - start
        rest = [c for c in long_stream]
        long_done_at = time.monotonic() - start
    assert first.value.flatten().tolist() == [0]
    assert first_at < long_done_at / 2  # the consumer got chunk one long before the producer ended
    assert short["out"].flatten().tolist() == [0, 2, 4]
    assert short_done_at < long_done_at  # a request waiting for chunks does not hold up another
    assert rest[-1].end


def test_a_payload_too_big_for_its_slot_fails_only_its_request(no_leaks):
    plan = compile_source(
        """pipeline p {
          stage up = python(fn=tests.runtime.stages.widen, inputs="in:tokens", outputs="out:tokens")
          stage down = python(fn=tests.runtime.stages.double, inputs="in:tokens", outputs="out:tokens")
          input x: tokens -> up
          up.out -> down [stream, chunk=8]
          down.out -> output y
        }""",
        "p.omni",
    )
    with Engine(plan, "process") as engine:
        pids = engine.executor_pids
        with pytest.raises(RequestFailed, match="does not fit a .*-byte slot"):
            engine.generate({"x": [[99]]})
        assert engine.generate({"x": [[3]]})["y"].flatten().tolist() == [6]
        assert engine.executor_pids == pids  # no executor died for it


@pytest.mark.parametrize("mode", ["inprocess", "process"])
def test_a_stage_that_cannot_load_is_one_clear_error(mode):
    plan = compile_source(
        """pipeline p {
          stage ok = python(fn=omniflow.runtime.builtin_stages.identity)
          stage broken = python(fn=tests.runtime.stages.no_such_function)
          input x: tokens -> ok
          ok.out -> broken.in [stream, chunk=8]
          broken.out -> output y
        }""",
        "p.omni",
    )
    with pytest.raises(
        OmniflowError,
        match="stage 'broken' could not load: cannot import 'tests.runtime.stages.no_such_function'",
    ):
        Engine(plan, mode)

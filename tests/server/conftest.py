"""Real `omniflow run` server processes on free local ports, for real clients.

`served` is the one server most tests share (started once per session): every example
pipeline on the tiny models, plus two python-stage pipelines (tests/server/probe.omni,
edit.omni), with small request defaults (`--param`) so that fuzzed requests stay short.
`start_server(...)` starts another, for a test module that needs other flags; every
server is stopped with SIGTERM at the end and must exit 0 leaving no shared memory.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from omniflow.runtime.shm_ring import segments

ROOT = Path(__file__).parents[2]
GRAPHS = ROOT / "graphs"
HERE = Path(__file__).parent
START_TIMEOUT_S = 180


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None):
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "omniflow.cli", "run", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # its own process group, as a terminal would give it
            text=True,
        )
        self.base = self._wait_ready()
        self.url = f"{self.base}/v1"

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 1.0)
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("omniflow: ready at "):
                    return line.split(" at ", 1)[1].strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited {self.proc.returncode}: {self.stderr()}")
        self.proc.kill()
        raise RuntimeError(f"the server did not start in {START_TIMEOUT_S} s: {self.stderr()}")

    def startup_log(self) -> str:
        """What the server wrote on stderr while it started (all of it is in the pipe once it
        is ready), read the first time without waiting for more; `stop` gets the rest."""
        if not hasattr(self, "_startup_log"):
            fd, chunks = self.proc.stderr.fileno(), []
            while select.select([fd], [], [], 0.5)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
            self._startup_log = b"".join(chunks).decode(errors="replace")
        return self._startup_log

    def suggested(self, pipeline: str) -> list[str]:
        """The `curl` lines the server suggested for `pipeline` at start-up: `  try NAME:
        curl ...`, and each line after it indented to its `curl`."""
        label = f"  try {pipeline}: "
        lines = self.startup_log().splitlines()
        first = next((i for i, line in enumerate(lines) if line.startswith(label)), None)
        if first is None:
            return []
        found = [lines[first].removeprefix(label)]
        for line in lines[first + 1 :]:
            if not line.startswith(" " * len(label) + "curl "):
                break
            found.append(line.strip())
        return found

    def stderr(self) -> str:
        try:
            return self.proc.communicate(timeout=10)[1]
        except subprocess.TimeoutExpired:
            return "(still running)"

    def pids(self) -> set[int]:
        """The server and its executor processes."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return {self.proc.pid, *map(int, out.stdout.split())}

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> tuple[int, str]:
        pids = self.pids()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        wait_until(lambda: not any(map(alive, pids)))
        return self.proc.returncode, err

    def stop_cleanly(self) -> str:
        """Stop with SIGTERM and check that it ended well: exit 0, no traceback in its log,
        none of its shared-memory segments left; its log."""
        pids = self.pids()
        code, err = self.stop()
        assert code == 0, err
        assert "Traceback" not in err, err
        assert segments_of(pids) == []
        return err

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base, **{"timeout": 60, **kwargs})


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def segments_of(pids: set[int]) -> list[str]:
    return [name for name, pid in segments().items() if pid in pids]


def run_async(make_coroutine):
    """`asyncio.run(make_coroutine())` in a thread of its own: immune to an event loop some
    other test left running in this one."""
    result = {}

    def run() -> None:
        try:
            result["value"] = asyncio.run(make_coroutine())
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def wait_until(condition, timeout: float = 30.0, step: float = 0.02) -> None:
    """Wait for `condition` (what the server settles into): the bound is generous, for a
    loaded machine; a condition that holds returns at once."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(step)


def metric(http, name: str, **labels) -> float:
    """The value of one series of the server's /metrics (0 if absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in http.get("/metrics").text.splitlines():
        match = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if match and ",".join(sorted(match.group(1).split(","))) == wanted:
            return float(match.group(2))
    return 0.0


def idle(http, model: str) -> bool:
    """Whether pipeline `model` holds no request: none admitted, none in any stage (not
    known while its executors are too busy to answer)."""
    state = http.get("/debug/inspect").json()[model]
    if "executors" not in state:
        return False
    calls = [c for e in state["executors"].values() for c in e["calls"].values()]
    return state["in_flight"] == 0 and not any(calls)


SMALL = ["--param", "max_tokens=6", "--param", "max_audio_tokens=60", "--param", "steps=2",
         "--param", "text_to_image.height=32", "--param", "text_to_image.width=32"]  # fmt: skip
PIPELINES = [str(GRAPHS / f"{name}.omni") for name in
             ("omni_chat", "tts", "text_to_image", "image_understanding")] + [
    str(HERE / "probe.omni"), str(HERE / "edit.omni")]  # fmt: skip


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """The shared server: every example pipeline (tiny) plus probe and edit, its executors
    threads of one process (they start in seconds; executor processes are tested with a
    server of their own, test_load.py)."""
    stats = tmp_path_factory.mktemp("stats") / "stats.jsonl"
    server = ServerProcess(
        [*PIPELINES, "--tiny", "--mode", "inprocess", *SMALL, "--log-stats-json", str(stats)]
    )
    server.stats_path = stats
    yield server
    server.stop_cleanly()


@pytest.fixture
def start_server():
    started = []

    def start(*args: str, env: dict | None = None) -> ServerProcess:
        server = ServerProcess(list(args), env)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.stop()

"""Faults injected into a real server's engine (a `sitecustomize` on its PYTHONPATH patches
it while a file the test creates exists):

- a request whose start fails (the encoding of its Start message raises) fails alone, a
  500 saying why, and the pipeline goes on serving (it stopped the whole engine);
- an engine whose I/O loop fails fails every later request with a 503 saying why, and
  `/health` answers 503 naming the pipeline and the reason (it said "ok" while every
  request failed); the server still stops cleanly.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.server.conftest import GRAPHS, ServerProcess

SPEECH = "/v1/audio/speech"
BODY = {"model": "tts", "input": "Hi.", "max_new_tokens": 6}
# Loaded at start-up by every process of the server: while the file `start` exists in
# OMNIFLOW_TEST_FAULTS, encoding a request's Start raises; while `loop` does, the engine's
# check of its executors (its I/O loop, in the API process alone) raises.
FAULTS = """
import os
from pathlib import Path

from omniflow.runtime import control, engine

_armed = Path(os.environ["OMNIFLOW_TEST_FAULTS"])
_encode, _check = control.encode, engine._Core.check_executors


def encode(message):
    if isinstance(message, control.Start) and (_armed / "start").exists():
        raise RuntimeError("a fault injected into a start")
    return _encode(message)


def check_executors(core):
    if (_armed / "loop").exists():
        raise RuntimeError("a fault injected into the loop")
    return _check(core)


control.encode, engine._Core.check_executors = encode, check_executors
"""


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def server(faults):
    site = faults.parent / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULTS)
    server = ServerProcess(
        [str(GRAPHS / "tts.omni"), "--tiny"],
        env={
            "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH")))),
            "OMNIFLOW_TEST_FAULTS": str(faults),
        },
    )
    yield server
    code, err = server.stop()
    assert code == 0, err


def test_a_request_that_cannot_start_fails_alone(server, faults):
    with server.client() as http:
        (faults / "start").touch()
        failed = http.post(SPEECH, json=BODY)
        (faults / "start").unlink()
        assert failed.status_code == 500, failed.text
        assert "a fault injected into a start" in failed.json()["error"]["message"]
        assert http.post(SPEECH, json=BODY).status_code == 200
        assert http.get("/health").json() == {"status": "ok", "models": ["tts"]}


def test_a_stopped_engine_fails_its_requests_and_health_says_so(server, faults):
    with server.client() as http:
        assert http.post(SPEECH, json=BODY).status_code == 200
        (faults / "loop").touch()
        deadline = time.monotonic() + 30  # the loop checks its executors every tick
        while (health := http.get("/health")).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        (faults / "loop").unlink()
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "failed"
        assert "a fault injected into the loop" in health.json()["failed"]["tts"]
        later = http.post(SPEECH, json=BODY)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_closed"
        assert "a fault injected into the loop" in later.json()["error"]["message"]

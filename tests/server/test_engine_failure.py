"""A pipeline whose engine stops (its I/O loop failed: a bug, here a fault injected into
the encoding of the messages that start a request) fails the request that met it and every
later one with a 503 saying why, and `/health` answers 503 naming the pipeline and the
reason (it said "ok" while every request failed); the server still stops cleanly."""

from __future__ import annotations

import os

import pytest

from tests.server.conftest import GRAPHS, ServerProcess

SPEECH = "/v1/audio/speech"
# Loaded at start-up by every process of the server (PYTHONPATH): while the file ARMED
# names exists, encoding a request's Start message raises.
FAULT = """
import os
from pathlib import Path

from omniflow.runtime import control

_encode, _armed = control.encode, Path(os.environ["OMNIFLOW_TEST_FAULT"])


def encode(message):
    if isinstance(message, control.Start) and _armed.exists():
        raise RuntimeError("a fault injected by the test")
    return _encode(message)


control.encode = encode
"""


@pytest.fixture(scope="module")
def armed(tmp_path_factory):
    return tmp_path_factory.mktemp("fault") / "armed"


@pytest.fixture(scope="module")
def server(armed):
    site = armed.parent / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULT)
    server = ServerProcess(
        [str(GRAPHS / "tts.omni"), "--tiny"],
        env={
            "PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH")))),
            "OMNIFLOW_TEST_FAULT": str(armed),
        },
    )
    yield server
    code, err = server.stop()
    assert code == 0, err


def test_a_stopped_engine_fails_its_requests_and_health_says_so(server, armed):
    body = {"model": "tts", "input": "Hi.", "max_new_tokens": 6}
    with server.client() as http:
        assert http.post(SPEECH, json=body).status_code == 200
        assert http.get("/health").json() == {"status": "ok", "models": ["tts"]}
        armed.touch()
        failed = http.post(SPEECH, json=body)
        armed.unlink()
        assert failed.status_code == 503, failed.text
        assert "a fault injected by the test" in failed.json()["error"]["message"]
        later = http.post(SPEECH, json=body)
        assert later.status_code == 503 and later.json()["error"]["code"] == "engine_closed"
        health = http.get("/health")
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "failed"
        assert "a fault injected by the test" in health.json()["failed"]["tts"]

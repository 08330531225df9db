"""`omniflow run` start-up mistakes: one line each, no traceback, before any model loads."""

import socket
import time

import pytest

from omniflow.cli import main
from tests.server.conftest import GRAPHS, HERE

CHAT = str(GRAPHS / "omni_chat.omni")
PROBE = str(HERE / "probe.omni")


@pytest.fixture
def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


MISTAKES = [
    ([CHAT, "--tiny", "--param", "nope=1"], 1, "--param nope=1: no served pipeline has a parameter 'nope'"),
    ([CHAT, "--tiny", "--param", "max_tokens=1e9"], 1,
     "--param for pipeline 'omni_chat': parameter 'max_tokens' must be int"),
    ([CHAT, "--tiny", "--param", "omni_chat.speaker=Bob"], 1, "unknown speaker 'Bob'"),
    ([CHAT, "--tiny", "--max-in-flight", "0"], 1, "--max-in-flight 0: expected a count of at least 1"),
    ([CHAT, "--tiny", "--max-in-flight", "tts=3"], 1, "no served pipeline 'tts' (omni_chat)"),
    ([PROBE, PROBE], 1, "pipeline name probe is served twice"),
    ([CHAT, PROBE, "--once"], 2, "--once runs one pipeline"),
    ([CHAT, PROBE, "--profile", "p"], 2, "POST /start_profile"),
    ([CHAT, "--tiny", "--profile", "p"], 2, "POST /start_profile"),
    (["/no/such.omni"], 2, "no such file: /no/such.omni"),
    ([PROBE, "--host", "no.such.host.invalid"], 1, "--host no.such.host.invalid"),
    ([PROBE, "--allowed-media-dir", "/no/such/dir"], 1, "--allowed-media-dir /no/such/dir: not a directory"),
    ([PROBE, "--allowed-media-dir", "/proc/self"], 1, "is in a pseudo filesystem"),
]  # fmt: skip


@pytest.mark.parametrize("argv, code, message", MISTAKES, ids=[m[2][:30] for m in MISTAKES])
def test_a_start_up_mistake_is_one_line(argv, code, message, capsys):
    start = time.perf_counter()
    assert main(["run", "--port", "0", *argv]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert err.count("\n") == 1
    assert time.perf_counter() - start < 30  # no model loaded


def test_a_busy_port_fails_before_anything_loads(busy_port, capsys):
    start = time.perf_counter()
    assert main(["run", CHAT, "--tiny", "--port", str(busy_port)]) == 1
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{busy_port}" in err and "pick another --port" in err
    assert time.perf_counter() - start < 5

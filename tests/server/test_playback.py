"""Playback underrun: the seconds a listener who starts at the first packet waits for later
ones; and the server exports it per reply with audio."""

import httpx
import pytest

from omniflow.server.playback import Playback


def listen(packets):
    playback = Playback()
    for now, seconds in packets:
        playback.arrived(now, seconds)
    return playback.underrun


def test_packets_that_arrive_before_the_audio_runs_out_never_stall():
    assert listen([(1.0, 0.5), (1.2, 0.5), (1.9, 0.5)]) == 0.0


def test_a_late_packet_stalls_the_listener_by_its_lateness():
    # 0.5 s plays from t=1.0 to 1.5; the next packet comes at 2.0: 0.5 s of silence, then
    # it plays until 2.5; the third comes at 2.4, in time.
    assert listen([(1.0, 0.5), (2.0, 0.5), (2.4, 0.5)]) == pytest.approx(0.5)


def test_stalls_add_up_and_the_first_packet_costs_nothing():
    assert listen([(5.0, 0.1), (5.3, 0.1), (5.6, 0.1)]) == pytest.approx(0.4)


def test_the_server_exports_each_audio_replys_underrun(served):
    body = {
        "model": "omni_chat",
        "messages": [{"role": "user", "content": "hi"}],
        "max_audio_tokens": 30,
        # A greedy talker: sampled (the graph's 0.9), the tiny one may end its speech at
        # once, and a reply without audio exports no underrun.
        "audio_temperature": 0,
        "stream": True,
        "audio": {"format": "pcm16"},
    }
    with httpx.Client(base_url=served.base, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            reply.read()
        metrics = http.get("/metrics").text
    count = [
        line
        for line in metrics.splitlines()
        if line.startswith('omniflow_playback_underrun_seconds_count{model="omni_chat"}')
    ]
    assert count and float(count[0].rsplit(" ", 1)[1]) >= 1

"""Playback slack (runtime/slack.py): when a listener runs dry, the order that puts the
driest first, when a chunk goes out short; and a paced edge's writer, whose chunks keep the
schedule's grid while its stream is ahead and go out at once while it is behind, and steps
sent ahead of a stream (a voice clone's reference frames), which take no place on it."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from omniflow.errors import OmniflowError
from omniflow.plan import ChannelPlan
from omniflow.runtime.edges import StreamWriter, chunk_end
from omniflow.runtime.port_values import Ahead
from omniflow.runtime.slack import (
    HOLD_S,
    HOLD_SHARE,
    HOLD_SPELL_S,
    HoldBudget,
    Playback,
    StepTimer,
    can_wait,
    cut_short,
    makers_can_wait,
    urgent_first,
)


def test_a_listener_runs_dry_when_what_it_was_sent_has_played():
    playback = Playback(opened=5.0)
    assert playback.runs_out(0.08) == 5.0  # nothing sent: as urgent as its opening
    playback.send(1, now=6.0)
    playback.send(9, now=6.5)
    assert math.isclose(playback.runs_out(0.08), 6.0 + 10 * 0.08)
    assert playback.runs_out(None) == 5.0  # no duration known: arrival order


def test_the_driest_goes_first_and_ties_keep_arrival_order():
    # (name, runs_out): the unsent ones count from their opening, the earliest first.
    streams = [("a", 10.0), ("b", 3.0), ("c", -math.inf), ("d", 3.0), ("e", -math.inf)]
    order = urgent_first(streams, lambda s: s[1])
    assert [name for name, _ in order] == ["c", "e", "b", "d", "a"]


def test_a_chunk_goes_out_short_when_its_listener_would_run_dry_waiting():
    assert cut_short(slack_s=0.1, missing=3, step_s=0.05)  # 0.15 s of making > 0.1 s left
    assert not cut_short(slack_s=1.0, missing=3, step_s=0.05)
    assert cut_short(slack_s=-0.2, missing=1, step_s=0.0)  # already dry
    assert not cut_short(slack_s=-0.2, missing=1, step_s=None)  # pace not known yet
    timer = StepTimer()
    timer.add(1, now=1.0)
    assert timer.step_s is None
    timer.add(2, now=1.2)
    assert math.isclose(timer.step_s, 0.1)


def test_a_stream_lets_a_first_packet_by_while_its_listener_has_audio_to_spare():
    playback = Playback(opened=1.0)
    assert not can_wait(playback.runs_out(0.08), now=1.0)  # nothing sent: it cannot wait
    playback.send(1, now=1.0)  # one 80 ms frame, above HOLD_S
    assert can_wait(playback.runs_out(0.08), now=1.0)
    assert not can_wait(playback.runs_out(0.08), now=1.08 - HOLD_S + 0.001)


def test_makers_wait_for_a_later_window_only_where_its_listener_needs_it_and_can_spare_them():
    """Omni chat at one stream (token2wav's 20 ms codes, its makers ~6.5 ms a code): the
    second window (24 codes, 480 ms) goes on the device 84 ms before the listener has
    played the first's 240 ms; the third window needs 24 codes more."""
    now, step_s = 0.404, 0.0065
    runs_out, window_s = 0.488, 24 * 0.02
    after = runs_out + window_s
    assert makers_can_wait(runs_out, window_s, after, now, 24, step_s)
    # A stream a window ahead of its listener needs no hold (Qwen3-TTS, 20x real time).
    assert not makers_can_wait(now + window_s, window_s, after + window_s, now, 24, step_s)
    # Nor one whose next window's codes would then come too late, nor one of unknown pace.
    assert not makers_can_wait(runs_out, window_s, after, now, 24, step_s=0.025)
    assert not makers_can_wait(runs_out, window_s, after, now, 24, step_s=None)


def test_first_packets_hold_the_running_streams_for_a_share_of_the_time_at_most():
    budget = HoldBudget()
    assert not budget.hold(False, now=0.0)
    assert budget.hold(True, now=0.001)  # a spell begins with a full bucket
    now, held = 0.001, 0.0
    while budget.hold(True, now + 0.001):  # wanted all along: held until the bucket is dry
        now += 0.001
        held += 0.001
    spell = HOLD_SPELL_S / (1 - HOLD_SHARE)
    assert spell - 0.002 < held < spell + 0.002
    now += 0.001
    assert not budget.hold(True, now + 0.001)  # still dry
    # Wanted nearly always, the streams are held a share of the time.
    start, held = now, 0.0
    for _ in range(10_000):
        now += 0.001
        held += 0.001 * budget.hold(True, now)
    assert abs(held / (now - start) - HOLD_SHARE) < 0.02
    assert budget.hold(False, now + 1.0) is False
    assert budget.hold(True, now + 1.001)  # a while unwanted: full again


def paced_edge(plays_s: float) -> ChannelPlan:
    return ChannelPlan(
        "talker.codes->code2wav.codes", "talker", "codes", "code2wav", "codes", "codes",
        "shm", "a", "b", "int64", [4], 64, [1, 2, 4, 8], carries_state=True, plays_s=plays_s,
    )  # fmt: skip


def chunks_of(edge: ChannelPlan, frames: int, switch: dict[int, float] | None = None):
    """The chunk sizes a paced writer sends for `frames` frames written one by one (the
    edge's plays_s changed to switch[i] before frame i), and the frames they carry."""
    sent = []
    writer = StreamWriter(edge, lambda rid, index, value, end, ending: sent.append(value))
    for i in range(frames):
        if switch and i in switch:
            edge.plays_s = switch[i]
        writer.write("r", torch.full((1, 4), i))
    writer.end("r")
    values = [v for v in sent if v is not None]
    return [len(v) for v in values], torch.cat(values)[:, 0].tolist()


def test_a_paced_edge_widens_on_its_grid_while_its_stream_is_ahead():
    # Each frame plays for 1000 s: the listener is always far ahead of running dry.
    sizes, frames = chunks_of(paced_edge(1000.0), 20)
    assert sizes == [1, 2, 4, 8, 5] and frames == list(range(20))


def test_a_paced_edge_sends_what_it_has_while_its_stream_is_behind_then_widens_on_its_grid():
    # A frame plays for a nanosecond: after its first chunk the listener is always dry, so
    # each frame goes out at once; once frames play long, the chunks end on the grid again.
    edge = paced_edge(1e-9)
    sizes, frames = chunks_of(edge, 5)
    assert sizes == [1, 1, 1, 1, 1] and frames == list(range(5))
    sizes, frames = chunks_of(dataclasses.replace(edge), 18, switch={3: 1000.0})
    # Frames 0-2 one by one (behind); then ahead: the grid's 3..7 and 7..15, and the rest.
    assert sizes == [1, 1, 1, 4, 8, 3] and frames == list(range(18))
    assert [chunk_end([1, 2, 4, 8], done) for done in (0, 1, 2, 3, 6, 7, 15)] == [
        1, 3, 3, 7, 7, 15, 23,
    ]  # fmt: skip


@pytest.mark.parametrize("plays_s", [None, 1000.0, 1e-9])
def test_steps_sent_ahead_go_at_once_in_slot_sized_chunks_off_the_schedule(plays_s):
    # 19 reference frames ahead of a stream of 7: in chunks of at most the schedule's
    # longest (8, what the edge's ring slots hold), then the stream's own from the
    # schedule's first chunk on (ahead of its listener, paced or not: 1, 2, 4).
    edge = dataclasses.replace(paced_edge(1000.0), plays_s=plays_s)
    sent = []
    writer = StreamWriter(edge, lambda rid, index, value, end, ending: sent.append((index, value)))
    writer.write("r", Ahead(torch.full((19, 4), -1)))
    for i in range(7):
        writer.write("r", torch.full((1, 4), i))
    writer.end("r")
    values = [v for _, v in sent if v is not None]
    sizes = [len(v) for v in values]
    stream = [1, 1, 1, 1, 1, 1, 1] if plays_s == 1e-9 else [1, 2, 4]  # dry: each at once
    assert sizes == [8, 8, 3, *stream]
    assert torch.cat(values)[:, 0].tolist() == [-1] * 19 + list(range(7))
    assert [index for index, _ in sent] == list(range(len(sent)))

    writer.write("late", torch.full((1, 4), 0))
    with pytest.raises(OmniflowError, match="ahead .* after the stream's own began"):
        writer.write("late", Ahead(torch.full((2, 4), -1)))


def test_on_a_whole_output_edge_steps_sent_ahead_are_its_first():
    edge = dataclasses.replace(paced_edge(1000.0), schedule=None, plays_s=None)
    sent = []
    writer = StreamWriter(edge, lambda rid, index, value, end, ending: sent.append(value))
    writer.write("r", Ahead(torch.full((3, 4), -1)))
    writer.write("r", torch.full((2, 4), 5))
    writer.end("r")
    assert len(sent) == 1 and sent[0][:, 0].tolist() == [-1, -1, -1, 5, 5]

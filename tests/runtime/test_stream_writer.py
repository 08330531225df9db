"""`StreamWriter` on an edge's schedule: one step at a time, a chunk as each completes;
a write of many steps at once, each chunk it completes on its own, or, where the writer
merges (a channel passing references in its process), all of them as one chunk that ends
on the same grid and counts the chunks it joins."""

import torch

from omniflow.plan import ChannelPlan
from omniflow.runtime.edges import StreamWriter


def edge(schedule: list[int]) -> ChannelPlan:
    return ChannelPlan(
        "thinker.hidden->talker.embeds", "thinker", "hidden", "talker", "embeds", "hidden",
        "local", "a", "b", "bfloat16", [4], 64, schedule,
    )  # fmt: skip


def sent_by(schedule: list[int], writes: list[int], merges: bool) -> list[tuple[int, list, bool]]:
    """(index, the steps' values, end) of each chunk sent for writes of `writes` steps."""
    sent = []
    writer = StreamWriter(
        edge(schedule),
        lambda rid, index, value, end, ending: sent.append(
            (index, [] if value is None else value[:, 0].tolist(), end)
        ),
        merges=merges,
    )
    step = 0
    for n in writes:
        writer.write("r", torch.arange(step, step + n)[:, None].expand(-1, 4).float())
        step += n
    writer.end("r")
    return sent


def test_a_prefill_of_many_steps_goes_out_as_one_chunk_where_the_writer_merges():
    prompt = list(range(6))
    assert sent_by([1], [6, 1], merges=False) == [
        *((i, [i], False) for i in prompt), (6, [6], False), (7, [], True)
    ]  # fmt: skip
    assert sent_by([1], [6, 1], merges=True) == [(0, prompt, False), (6, [6], False), (7, [], True)]


def test_a_merged_chunk_ends_on_the_schedules_grid_and_counts_the_chunks_it_joins():
    # schedule 2, 4, 4, ...: 7 steps complete 2 + 4 (one chunk, indices 0 and 1), 1 pending;
    # 4 more complete the next (2 + 4 + 4 = 10), 1 pending goes at the end.
    assert sent_by([2, 4], [7, 4], merges=True) == [
        (0, list(range(6)), False), (2, [6, 7, 8, 9], False), (3, [10], True)
    ]  # fmt: skip
    assert [len(v) for _, v, _ in sent_by([2, 4], [7, 4], merges=False)] == [2, 4, 4, 1]


def test_one_step_at_a_time_is_the_same_merged_or_not():
    one_by_one = [1] * 9
    assert sent_by([2, 4], one_by_one, True) == sent_by([2, 4], one_by_one, False)

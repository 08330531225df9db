"""`gpu_time`: each GPU stream's busy time and costliest kernels, and the GPU's busy time
over the kernels' span, read from a trace written by trace.py."""

from omniflow.profiler.gpu_time import format_gpu_time, gpu_time
from omniflow.profiler.trace import chrome_trace
from omniflow.runtime.control import Profiled


def test_busy_time_merges_overlaps_within_a_stream_and_across_the_gpu():
    # ns: the talker's two kernels overlap each other (1-6 us, 4-9 us: 8 us busy); the
    # vocoder's run 5-8 us and 20-22 us; the GPU is busy 1-9 and 20-22 us of a 21 us span.
    kernels = [
        ("gemv", 1_000, 5_000, 0, 7),
        ("gemv", 4_000, 5_000, 0, 7),
        ("attention", 5_000, 3_000, 0, 13),
        ("snake", 20_000, 2_000, 0, 13),
    ]
    profile = Profiled(
        "gpu0", [], [], b"", kernels=kernels, streams=[(7, "talker"), (13, "code2wav")]
    )
    (found,) = gpu_time(chrome_trace([profile], "p"))
    assert found.process == "gpu0"
    assert abs(found.span - 21.0) < 1e-6 and abs(found.busy - 10.0) < 1e-6
    talker, vocoder = found.streams  # busiest first
    assert talker.track == "gpu 0 stream 7: talker's kernels" and abs(talker.busy - 8.0) < 1e-6
    assert talker.kernels == 2 and talker.costliest(1) == [("gemv", 10.0)]
    assert vocoder.track.endswith("code2wav's kernels") and abs(vocoder.busy - 5.0) < 1e-6
    assert [name for name, _ in vocoder.costliest(5)] == ["attention", "snake"]
    table = format_gpu_time([found], count=1)
    assert "GPU busy 0.0 of 0.0 ms (48%" in table and "talker's kernels: busy 0.0 ms (38%)" in table


def test_a_trace_without_kernels_has_no_gpu_time():
    profile = Profiled("cpu", [], [], b"")
    assert gpu_time(chrome_trace([profile], "p")) == []

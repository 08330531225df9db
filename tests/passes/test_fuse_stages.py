"""The executor rule: one process per GPU (each stage on its own stream, priorities by
nearness to the outputs), a process of its own for a stage that asks, and off GPUs one
process per stage but for per-token streams."""

from omniflow.passes.fuse_stages import hops_to_outputs
from tests.passes.helpers import GRAPHS, run_until

OMNI_CHAT = ("hearing", "vision", "thinker", "talker", "code2wav")


def _executors(graph):
    return {x.name: x for x in graph.meta["executors"]}


def test_one_gpu_runs_every_stage_in_one_process():
    graph = run_until("fuse_stages", "omni_chat", devices="1xH200")
    (executor,) = graph.meta["executors"]
    assert executor.stages == OMNI_CHAT and executor.devices == ("cuda:0",)
    assert "one process per GPU" in executor.reasons[0]
    assert {graph.node(s).meta["executor"] for s in OMNI_CHAT} == {executor.name}
    assert graph.node("prompt").meta["executor"] == "frontend"


def test_two_gpus_run_one_process_each():
    graph = run_until("fuse_stages", "omni_chat", devices="2xH200")
    by_device = {x.devices: x for x in graph.meta["executors"]}
    assert set(by_device) == {("cuda:0",), ("cuda:1",)}
    for devices, executor in by_device.items():
        for stage in executor.stages:
            assert graph.node(stage).meta["placement"].devices == devices
    reasons = " ".join(r for x in by_device.values() for r in x.reasons)
    assert "talker.codes->code2wav.codes on different devices" in reasons


def test_stream_priorities_rise_toward_the_listener():
    graph = run_until("fuse_stages", "omni_chat", devices="1xH200")
    (executor,) = graph.meta["executors"]
    priority = dict(zip(executor.stages, executor.priorities, strict=True))
    # the vocoder feeds the listener, the talker feeds it, the thinker the talker, the towers
    # the thinker (its text reaching an output directly does not make it nearer: its audio
    # still passes through two stages)
    assert priority["code2wav"] < priority["talker"] < priority["thinker"] < priority["hearing"]
    assert priority["hearing"] == priority["vision"] == 0  # the farthest run at CUDA's default
    assert hops_to_outputs(graph) == {
        "hearing": 3, "vision": 3, "thinker": 2, "talker": 1, "code2wav": 0,
    }  # fmt: skip
    assert "code2wav (stream priority -3)" in str(executor)


def test_priorities_are_by_graph_distance_not_by_name():
    # The same shape under other names: a chain of three, the last writing the output.
    graph = run_until(
        "fuse_stages",
        """pipeline p {
          stage a = python(fn=m.f, inputs="in:text", outputs="out:text")
          stage b = python(fn=m.f, inputs="in:text", outputs="out:text")
          stage c = python(fn=m.f, inputs="in:text", outputs="out:text")
          input x: text -> a
          a.out -> b [stream, chunk=64]
          b.out -> c [stream, chunk=64]
          c.out -> output y
        }""",
        devices="1xH200",
    )
    (executor,) = graph.meta["executors"]
    assert executor.stages == ("a", "b", "c") and executor.priorities == (0, -1, -2)


def test_a_stage_that_asks_to_be_isolated_gets_a_process_of_its_own():
    source = (GRAPHS / "omni_chat.omni").read_text()
    source = source.replace(
        "speaker=$speaker, lookahead=12)", "speaker=$speaker, lookahead=12, isolate=true)"
    )
    graph = run_until("fuse_stages", source, devices="1xH200")
    executors = _executors(graph)
    assert set(executors) == {"hearing+vision+thinker+talker", "code2wav"}
    assert "isolate=true: a process of its own" in executors["code2wav"].reasons[0]
    split = " ".join(executors["hearing+vision+thinker+talker"].reasons)
    assert "talker.codes->code2wav.codes code2wav asked for a process of its own" in split
    assert executors["code2wav"].priorities == (0,)  # alone on its stream


def test_off_gpus_only_per_token_streams_share_a_process():
    graph = run_until("fuse_stages", "omni_chat", devices="cpu=512GiB")
    executors = _executors(graph)
    # separate processes run in parallel on a CPU's cores: the towers' whole-output edges and
    # the chunked codes stay process boundaries, the per-token hidden states do not
    assert set(executors) == {"hearing", "vision", "thinker+talker", "code2wav"}
    assert all(x.priorities == () for x in executors.values())  # no CUDA streams
    reasons = " ".join(executors["thinker+talker"].reasons)
    assert "fused: thinker.hidden->talker.embeds streams chunk=1" in reasons
    assert (
        "split from code2wav: talker.codes->code2wav.codes chunked stream (chunk=auto) on cpu"
        in reasons
    )
    assert "whole-output edge on cpu" in " ".join(executors["hearing"].reasons)


def test_every_example_follows_the_rule_on_one_and_two_gpus():
    for path in sorted(GRAPHS.glob("*.omni")):
        for devices, count in (("1xH200", 1), ("2xH200", 2)):
            graph = run_until("fuse_stages", path.stem, devices=devices)
            placed = {n.meta["placement"].devices for n in graph.stages}
            assert len(graph.meta["executors"]) == len(placed) <= count, (path.stem, devices)

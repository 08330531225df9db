import re

import pytest

from omniflow.devices import GiB
from omniflow.errors import PassError, PlacementError
from omniflow.passes.pipeline import Target
from tests.passes.helpers import run_until

TWO_LMS = """pipeline p {
  model "Qwen/Qwen2.5-7B-Instruct"
  stage a = ar(max_batch=8) DEVA
  stage b = ar(max_batch=8) DEVB
  input x: chat -> a
  a.hidden -> b [stream, chunk=1]
  b.text -> output t
  EXTRA
}"""


def two_lms(dev_a="", dev_b="", extra=""):
    return TWO_LMS.replace("DEVA", dev_a).replace("DEVB", dev_b).replace("EXTRA", extra)


def test_every_stage_gets_a_device_and_budgets_fill_but_never_exceed_it():
    graph = run_until("place", "omni_chat")
    for node in graph.stages:
        assert node.meta["placement"].device in ("cuda:0", "cuda:1")
        assert node.meta["placement"].budget >= node.meta["cost"].need
    for use in graph.meta["devices"]:
        here = [n for n in graph.stages if n.meta["placement"].device == use.name]
        assert (
            use.used <= use.usable and sum(n.meta["placement"].budget for n in here) <= use.usable
        )


def test_per_token_streams_pull_stages_onto_one_device():
    graph = run_until("place", "omni_chat")
    assert (
        graph.node("thinker").meta["placement"].device
        == graph.node("talker").meta["placement"].device
    )
    assert (
        graph.node("code2wav").meta["placement"].device
        != graph.node("thinker").meta["placement"].device
    )


def test_slack_goes_to_kv_caches():
    graph = run_until("place", "omni_chat")
    thinker, talker = graph.node("thinker").meta, graph.node("talker").meta
    extra_thinker = thinker["placement"].budget - thinker["cost"].need
    extra_talker = talker["placement"].budget - talker["cost"].need
    ratio = thinker["cost"].cost.kv_cache_bytes / talker["cost"].cost.kv_cache_bytes
    assert extra_thinker / extra_talker == pytest.approx(ratio, rel=1e-3)


def test_pins_and_separate_are_honored():
    graph = run_until("place", two_lms(dev_b="@ cuda:1"), devices="2xH200")
    assert graph.node("b").meta["placement"].device == "cuda:1"
    graph = run_until("place", two_lms(extra="separate a, b"), devices="2xH200")
    assert graph.node("a").meta["placement"].device != graph.node("b").meta["placement"].device


def test_a_pipeline_that_cannot_fit_names_stage_and_bytes():
    with pytest.raises(PassError, match="pass 'place'") as info:
        run_until("place", "omni_chat", devices="cuda:0=16GiB")
    err = info.value.cause
    assert isinstance(err, PlacementError)
    message = str(err)
    assert "stage 'thinker' needs" in message and "weights 14.2 GiB" in message
    assert "cuda:0 has" in message and "GiB free" in message


def test_a_stage_short_of_room_is_told_what_else_it_takes_and_the_batch_that_fits():
    devices = "cuda:0=18GiB,cuda:1=18GiB"
    with pytest.raises(PassError) as info:
        run_until("place", two_lms(), devices=devices)
    message = str(info.value.cause)
    assert "stage 'a' needs" in message and "for its process's CUDA context" in message
    batch = int(re.search(r"at max_batch=(\d+) \(KV cache [\d.]+ MiB a request\)", message)[1])
    assert 1 <= batch < 8
    run_until("place", two_lms().replace("max_batch=8", f"max_batch={batch}"), devices=devices)
    with pytest.raises(PassError, match="stage 'a' needs"):
        run_until(
            "place", two_lms().replace("max_batch=8", f"max_batch={batch + 1}"), devices=devices
        )


def test_pin_to_a_missing_device_is_an_error():
    with pytest.raises(PassError, match="pinned to cuda:5, but the devices are cuda:0, cuda:1"):
        run_until("place", two_lms(dev_a="@ cuda:5"), devices="2xH200")


def chain_of_budgeted_stages(names: str, isolate: str = "") -> str:
    """Stages of 10 GiB each, in a line; on a GPU, their process adds 1 GiB (a CUDA context),
    and so does each stage named in `isolate`, which asks for a process of its own."""
    stages = "\n".join(
        f'  stage {n} = ar(memory="10GiB"{", isolate=true" if n in isolate else ""})' for n in names
    )
    flows = "\n".join(
        f"  {a}.hidden -> {b} [stream, chunk=1]" for a, b in zip(names, names[1:], strict=False)
    )
    return f"""pipeline p {{
  model "Qwen/Qwen2.5-7B-Instruct"
{stages}
  input x: chat -> {names[0]}
{flows}
  {names[-1]}.text -> output t
}}"""


@pytest.mark.parametrize(
    ("names", "isolate", "devices", "held"),
    [
        ("ab", "", "cuda:0=16GiB", "a already holds 11.0 GiB"),
        ("abc", "", "cuda:0=24GiB", "a, b already hold 21.0 GiB"),  # one process: one context
        ("abc", "b", "cuda:0=24GiB", "a, b already hold 22.0 GiB"),  # b's process: one more
    ],
)
def test_a_placement_failure_says_what_the_device_already_holds(names, isolate, devices, held):
    with pytest.raises(PassError) as info:
        run_until("place", chain_of_budgeted_stages(names, isolate), devices=devices)
    assert held in str(info.value.cause)


def test_a_gpu_is_charged_one_context_per_process():
    overhead = Target(()).process_overhead
    for isolate, processes in (("", 1), ("b", 2), ("abc", 3)):
        graph = run_until("place", chain_of_budgeted_stages("abc", isolate), devices="1xH200")
        (use,) = graph.meta["devices"]
        assert use.used == 3 * 10 * GiB + processes * overhead
    graph = run_until("place", chain_of_budgeted_stages("abc"), devices="cpu=64GiB")
    assert graph.meta["devices"][0].used == 3 * 10 * GiB  # no CUDA context off GPUs


@pytest.mark.parametrize(("isolate", "contexts"), [("", 1), ("c", 2), ("ce", 3)])
def test_a_gpus_total_is_its_stages_budgets_and_one_context_per_process(isolate, contexts):
    """Five stages on one GPU share one process: one CUDA context; each isolated stage's
    process adds one. The device's total is its stages' budgets plus those contexts."""
    graph = run_until("place", chain_of_budgeted_stages("abcde", isolate), devices="1xH200")
    (use,) = graph.meta["devices"]
    overhead = Target(()).process_overhead
    assert (use.contexts, use.context_bytes) == (contexts, overhead)
    budgets = sum(n.meta["placement"].budget for n in graph.stages)
    assert use.total == budgets + contexts * overhead <= use.usable
    assert f"CUDA contexts {contexts} x 1.0 GiB" in str(use)


# node1's GPU comes before node0's second in the inventory, so only the node preference
# keeps b beside a when a separate constraint keeps it off a's device.
INTERLEAVED = "node0=cuda:0=140GiB,node1=cuda:0=140GiB,node0=cuda:1=140GiB"


def test_a_per_token_stream_stays_within_a_node_and_the_plan_says_why():
    graph = run_until("plan_buffers", two_lms(extra="separate a, b"), devices=INTERLEAVED)
    assert graph.node("a").meta["placement"].device == "node0/cuda:0"
    assert graph.node("b").meta["placement"].device == "node0/cuda:1"
    assert "per-token streams stay within a node" in graph.node("b").meta["placement"].placed[0]
    edge = next(e for e in graph.edges if e.name == "a.hidden->b.embeds")
    assert edge.meta["channel"].kind == "p2p"  # two GPUs of one node
    assert not any("across nodes" in w for w in graph.meta["warnings"])


def test_a_per_token_stream_that_must_cross_nodes_is_a_net_edge_with_a_warning():
    graph = run_until(
        "plan_buffers", two_lms(extra="separate a, b"), devices="node0=1xH200,node1=1xH200"
    )
    edge = next(e for e in graph.edges if e.name == "a.hidden->b.embeds")
    assert edge.meta["channel"].kind == "net"
    assert edge.meta["channel"].device == ""  # frames land in host slots
    assert any(
        "a.hidden->b.embeds streams per token across nodes (node0 vs node1)" in w
        for w in graph.meta["warnings"]
    )


def test_chunked_edges_may_cross_nodes_and_the_frontend_lives_on_the_first():
    graph = run_until("plan_buffers", "omni_chat", devices="node0=1xH100=20GiB,node1=2xH200")
    kinds = {e.name: e.meta["channel"].kind for e in graph.edges}
    # thinker+talker fit only node1; code2wav fits node0: the chunked codes cross
    assert (
        graph.node("thinker").meta["placement"].device
        == graph.node("talker").meta["placement"].device
    )
    assert graph.node("thinker").meta["placement"].device.startswith("node1/")
    assert kinds["thinker.hidden->talker.embeds"] == "local"
    assert kinds["talker.codes->code2wav.codes"] == "net"
    assert kinds["prompt.out->thinker.prompt"] == "net"  # the frontend runs on node0
    assert not any("across nodes" in w for w in graph.meta["warnings"])

import pytest

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
        assert node.meta["device"] in ("cuda:0", "cuda:1")
        assert node.meta["budget"] >= node.meta["need"]
    for device, (used, usable) in graph.meta["device_usage"].items():
        budgets = sum(n.meta["budget"] for n in graph.stages if n.meta["device"] == device)
        assert used <= usable and budgets <= usable


def test_per_token_streams_pull_stages_onto_one_device():
    graph = run_until("place", "omni_chat")
    assert graph.node("thinker").meta["device"] == graph.node("talker").meta["device"]
    assert graph.node("code2wav").meta["device"] != graph.node("thinker").meta["device"]


def test_slack_goes_to_kv_caches():
    graph = run_until("place", "omni_chat")
    thinker, talker = graph.node("thinker").meta, graph.node("talker").meta
    overhead = Target(()).process_overhead  # each GPU executor's share, charged per stage
    extra_thinker = thinker["budget"] - thinker["need"] - overhead
    extra_talker = talker["budget"] - talker["need"] - overhead
    ratio = thinker["cost"].kv_cache_bytes / talker["cost"].kv_cache_bytes
    assert extra_thinker / extra_talker == pytest.approx(ratio, rel=1e-3)


def test_pins_and_separate_are_honored():
    graph = run_until("place", two_lms(dev_b="@ cuda:1"), devices="2xH200")
    assert graph.node("b").meta["device"] == "cuda:1"
    graph = run_until("place", two_lms(extra="separate a, b"), devices="2xH200")
    assert graph.node("a").meta["device"] != graph.node("b").meta["device"]


def test_replicas_land_on_distinct_devices():
    src = two_lms().replace("stage b = ar(max_batch=8)", "stage b = ar(max_batch=8, replicas=3)")
    graph = run_until("place", src, devices="4xH100")
    assert len(set(graph.node("b").meta["devices"])) == 3


def test_a_pipeline_that_cannot_fit_names_stage_and_bytes():
    with pytest.raises(PassError, match="pass 'place'") as info:
        run_until("place", "omni_chat", devices="cuda:0=16GiB")
    err = info.value.cause
    assert isinstance(err, PlacementError)
    message = str(err)
    assert "stage 'thinker' needs" in message and "weights 16.6 GiB" in message
    assert "cuda:0 has" in message and "GiB free" in message


def test_pin_to_a_missing_device_is_an_error():
    with pytest.raises(PassError, match="pinned to cuda:5, but the devices are cuda:0, cuda:1"):
        run_until("place", two_lms(dev_a="@ cuda:5"), devices="2xH200")


def chain_of_budgeted_stages(names: str) -> str:
    """Stages of 10 GiB each (11 GiB with a GPU process's overhead), in a line."""
    stages = "\n".join(f'  stage {n} = ar(memory="10GiB")' for n in names)
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
    ("names", "devices", "held"),
    [
        ("ab", "cuda:0=16GiB", "a already holds 11.0 GiB"),
        ("abc", "cuda:0=24GiB", "a, b already hold 22.0 GiB"),
    ],
)
def test_a_placement_failure_says_what_the_device_already_holds(names, devices, held):
    with pytest.raises(PassError) as info:
        run_until("place", chain_of_budgeted_stages(names), devices=devices)
    assert held in str(info.value.cause)

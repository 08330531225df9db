"""The compiler's passes, drawn: `run_passes` tells its hook of every pass, and the snapshots
say what each pass changed (types, devices, fusion, chunk schedules, buffers)."""

from pathlib import Path

from omniflow.compiler import load_graph, optimize
from omniflow.passes.pipeline import default_passes
from omniflow.profiler.viz import PassSnapshots, graph_model, show

GRAPHS = Path(__file__).parents[2] / "graphs"


def test_the_hook_hears_of_every_pass_with_its_input_and_output():
    heard = []
    graph = load_graph(GRAPHS / "tts.omni")
    result = optimize(graph, on_pass=lambda name, a, b, s: heard.append((name, a, b, s)))
    assert [h[0] for h in heard] == [p.__name__ for p in default_passes()]
    assert heard[0][1] is graph and heard[-1][2] is result
    assert all(a is not b and s >= 0 for _n, a, b, s in heard)
    assert all(heard[i][2] is heard[i + 1][1] for i in range(len(heard) - 1))


def test_each_pass_s_changes_are_named_by_what_they_decide():
    snapshots = PassSnapshots()
    optimize(load_graph(GRAPHS / "omni_chat.omni"), "2xH200", on_pass=snapshots)
    names = [s.name for s in snapshots.snapshots]
    assert names == ["source", *(p.__name__ for p in default_passes())]
    categories = {s.name: {c["category"] for c in s.changes} for s in snapshots.snapshots}
    assert categories["source"] == set()
    assert categories["resolve_models"] == {"models"}
    assert "types" in categories["infer_types"] and "costs" in categories["estimate_costs"]
    assert "devices" in categories["place"] and "fusion" in categories["fuse_stages"]
    assert categories["fuse_pointwise"] == {"fusion"}
    assert categories["size_chunks"] == {"chunks"} and "buffers" in categories["plan_buffers"]
    place = snapshots.snapshots[4]
    placed = {c["where"]: c["value"] for c in place.changes if c["key"] == "placement"}
    assert set(placed) == {"hearing", "vision", "thinker", "talker", "code2wav"}
    # The last drawing groups the fused pair in one executor, on its device.
    final = snapshots.snapshots[-1].graph
    clusters = {c["id"]: c for c in final["clusters"]}
    fused = clusters["executor:thinker+talker"]
    assert "fused" in fused["cls"] and fused["parent"].startswith("device:cuda:")
    assert fused["parent"].removeprefix("device:") in placed["thinker"]
    nodes = {n["id"]: n for n in final["nodes"]}
    assert nodes["talker"]["parent"] == "executor:thinker+talker"
    edges = {e["id"]: e for e in final["edges"]}
    assert any("ring 128" in line for line in edges["talker.codes->code2wav.codes"]["label"])
    assert "changed" in edges["talker.codes->code2wav.codes"]["cls"]


def test_a_graph_before_any_pass_draws_without_devices_or_executors():
    model = graph_model(load_graph(GRAPHS / "text_to_image.omni"))
    assert model["clusters"] == [] and all(n["parent"] is None for n in model["nodes"])
    assert show(list(range(20))).endswith("…]") and len(show("x" * 1000)) <= 220

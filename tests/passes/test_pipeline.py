"""The pass pipeline times every pass, lints after each, and names a failing pass."""

import pytest

from omniflow.compiler import load_graph
from omniflow.devices import parse_devices
from omniflow.errors import GraphError, LintError, PassError
from omniflow.ir.graph import Node
from omniflow.passes.pipeline import Target, default_passes, run_passes

TARGET = Target(tuple(parse_devices("2xH200")))


def test_every_pass_is_timed_in_order():
    graph = run_passes(load_graph("graphs/omni_chat.omni"), TARGET)
    assert list(graph.meta["pass_times"]) == [p.__name__ for p in default_passes()]
    assert all(t >= 0 for t in graph.meta["pass_times"].values())


def test_passes_do_not_mutate_their_input():
    graph = load_graph("graphs/omni_chat.omni")
    before = graph.copy()
    run_passes(graph, TARGET)
    assert graph == before
    assert all(not n.meta for n in graph.nodes)


def test_a_failing_pass_is_named():
    def explode(graph, target):
        raise GraphError("boom")

    with pytest.raises(PassError, match="pass 'explode' failed: error: boom") as info:
        run_passes(load_graph("graphs/tts.omni"), TARGET, [explode])
    assert info.value.pass_name == "explode"


def test_lint_runs_after_each_pass():
    def break_graph(graph, target):
        graph = graph.copy()
        graph.add_node(Node("orphan", "ar"))
        return graph

    with pytest.raises(PassError, match="pass 'break_graph'") as info:
        run_passes(load_graph("graphs/tts.omni"), TARGET, [break_graph])
    assert isinstance(info.value.cause, LintError)
    assert info.value.cause.node == "orphan"

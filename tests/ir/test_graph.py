"""The IR: printing, to_dsl round trips, equality and lint."""

from pathlib import Path

import pytest

from omniflow.compiler import graph_from_source, load_graph
from omniflow.errors import LintError
from omniflow.ir.graph import Edge, Graph, Node

EXAMPLES = sorted(Path(__file__).parents[2].joinpath("graphs").glob("*.omni"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_to_dsl_round_trips(path):
    graph = load_graph(path)
    text = graph.to_dsl()
    again = graph_from_source(text, "roundtrip.omni")
    assert again == graph
    assert again.to_dsl() == text


def test_equality_sees_a_changed_attribute():
    graph = load_graph(EXAMPLES[0])
    other = graph.copy()
    assert other == graph
    other.edges[1].context += 1
    assert other != graph


def test_str_lists_nodes_in_topological_order_and_edges():
    text = str(load_graph(Path("graphs/omni_chat.omni")))
    lines = text.splitlines()
    assert lines[0].startswith("graph omni_chat  model=Qwen/Qwen2.5-Omni-7B")
    order = [
        ln.split()[1].rstrip(":")
        for ln in lines[1:]
        if ln.split()[0] in ("input", "stage", "output")
    ]
    assert (
        order.index("prompt")
        < order.index("thinker")
        < order.index("talker")
        < order.index("code2wav")
    )
    assert any(
        "thinker.hidden->talker.embeds : hidden stream chunk=1 adapter=qwen_omni.thinker_to_talker"
        in ln
        for ln in lines
    )
    assert any("map(gain(0.9) | clamp(-1, 1) | pcm16)" in ln for ln in lines)


def _tiny() -> Graph:
    graph = Graph("g", model="m")
    graph.add_node(Node("x", "input", {"type": "chat"}))
    graph.add_node(Node("lm", "ar"))
    graph.add_node(Node("y", "output"))
    graph.add_edge(Edge("x", "out", "lm", "prompt", "chat"))
    graph.add_edge(Edge("lm", "text", "y", "in", "text"))
    return graph


def test_lint_accepts_a_valid_graph():
    assert _tiny().lint() is not None


@pytest.mark.parametrize(
    "mutate,node,message",
    [
        (lambda g: g.add_edge(Edge("lm", "txt", "y", "in", "text")), "lm", "no output port 'txt'"),
        (
            lambda g: g.add_edge(Edge("x", "out", "lm", "embeds", "chat")),
            "lm",
            "does not accept chat",
        ),
        (lambda g: g.add_edge(Edge("x", "out", "lm", "prompt", "chat")), "lm", "has 2 producers"),
        (lambda g: g.add_node(Node("idle", "ar")), "idle", "has no input"),
        (lambda g: g.add_node(Node("odd", "warp")), "odd", "unknown stage kind"),
        (
            lambda g: (
                g.add_node(Node("b", "ar")),
                g.add_edge(Edge("lm", "hidden", "b", "embeds", "hidden")),
                g.add_edge(Edge("b", "hidden", "lm", "embeds", "hidden")),
            ),
            "lm",
            "is on a cycle: lm -> b -> lm",
        ),
    ],
)
def test_lint_names_the_bad_node(mutate, node, message):
    graph = _tiny()
    mutate(graph)
    with pytest.raises(LintError) as info:
        graph.lint()
    assert info.value.node == node
    assert message in str(info.value)


def test_adding_an_edge_to_a_missing_node_names_it():
    with pytest.raises(LintError, match="node 'nowhere'"):
        _tiny().add_edge(Edge("lm", "text", "nowhere", "in", "text"))

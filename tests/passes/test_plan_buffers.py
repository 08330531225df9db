from omniflow.passes.plan_buffers import DEFAULT_CREDITS, SLOT_ALIGN
from tests.passes.helpers import run_until


def _channel(graph, name):
    edge = next(e for e in graph.edges if e.name == name)
    return edge, edge.meta["channel"]


def test_fused_edges_pass_references():
    graph = run_until("plan_buffers", "omni_chat")
    _, channel = _channel(graph, "thinker.hidden->talker.embeds")
    assert channel == {"kind": "local", "slots": 0, "slot_bytes": 0, "ring_bytes": 0}


def test_ring_holds_the_largest_chunk_times_credits_per_batched_request():
    graph = run_until("plan_buffers", "omni_chat")
    edge, channel = _channel(graph, "talker.codes->code2wav.codes")
    assert channel["kind"] == "shm"
    item = edge.meta["item"].item_bytes()
    assert channel["slot_bytes"] >= item * max(edge.meta["schedule"])
    assert channel["slot_bytes"] % SLOT_ALIGN == 0
    assert channel["slots"] == DEFAULT_CREDITS * 64  # code2wav batches 64 requests
    assert channel["ring_bytes"] == channel["slots"] * channel["slot_bytes"]


def test_whole_edges_hold_the_whole_output_and_credits_can_be_set():
    src = (
        'pipeline p { model "Qwen/Qwen2.5-0.5B-Instruct"\n stage lm = ar(max_batch=4, max_tokens=96)\n'
        " input x: chat -> lm\n lm.tokens -> output t [credits=3] }"
    )
    graph = run_until("plan_buffers", src, devices="cpu")
    _, channel = _channel(graph, "lm.tokens->t.in")
    assert channel["slot_bytes"] == 8 * 96
    assert channel["slots"] == 3 * 4
    assert graph.meta["shm_bytes"] == sum(e.meta["channel"]["ring_bytes"] for e in graph.edges)

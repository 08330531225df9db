from omniflow.ir.kinds import requests_at_once
from omniflow.passes.common import Target
from omniflow.passes.facts import Channel
from omniflow.passes.plan_buffers import DEFAULT_CREDITS, SLOT_ALIGN
from tests.passes.helpers import GRAPHS, run_until


def _channel(graph, name):
    edge = next(e for e in graph.edges if e.name == name)
    return edge, edge.meta["channel"]


def test_fused_edges_pass_references():
    graph = run_until("plan_buffers", "omni_chat")
    _, channel = _channel(graph, "thinker.hidden->talker.embeds")
    assert channel == Channel("local") and channel.ring_bytes == 0


def test_ring_holds_the_largest_chunk_times_credits_per_batched_request():
    graph = run_until("plan_buffers", "omni_chat")
    edge, channel = _channel(graph, "talker.codes->code2wav.codes")
    assert channel.kind == "p2p"  # talker on cuda:0, code2wav on cuda:1
    item = edge.meta["item"].item.item_bytes()
    assert channel.slot_bytes >= item * max(edge.meta["schedule"])
    assert channel.slot_bytes % SLOT_ALIGN == 0
    assert channel.slots == DEFAULT_CREDITS * 64  # code2wav batches 64 requests
    assert channel.ring_bytes == channel.slots * channel.slot_bytes


def test_whole_edges_hold_the_whole_output_and_credits_can_be_set():
    src = (
        'pipeline p { model "Qwen/Qwen2.5-0.5B-Instruct"\n stage lm = ar(max_batch=4, max_tokens=96)\n'
        " input x: chat -> lm\n lm.tokens -> output t [credits=3] }"
    )
    graph = run_until("plan_buffers", src, devices="cpu")
    _, channel = _channel(graph, "lm.tokens->t.in")
    assert channel.slot_bytes == 8 * 96
    assert channel.slots == 3 * 4
    assert graph.meta["shm_bytes"] == sum(e.meta["channel"].ring_bytes for e in graph.edges)


def _kinds(graph) -> dict[str, tuple[str, str]]:
    return {e.name: (e.meta["channel"].kind, e.meta["channel"].device) for e in graph.edges}


def test_edge_kinds_follow_placement_on_two_gpus():
    kinds = _kinds(run_until("plan_buffers", "omni_chat"))
    assert kinds["thinker.hidden->talker.embeds"] == ("local", "")  # fused: one executor
    # talker on cuda:0, code2wav on cuda:1: a ring in the consumer's GPU, filled by a peer copy
    assert kinds["talker.codes->code2wav.codes"] == ("p2p", "cuda:1")
    assert kinds["thinker.text->text.in"] == ("shm", "")  # text, and the frontend is on the host
    assert kinds["prompt.out->thinker.prompt"] == ("shm", "")


def isolated_decoder_tts() -> str:
    """graphs/tts.omni with its decoder in a process of its own."""
    text = (GRAPHS / "tts.omni").read_text()
    return text.replace("max_batch=32)", "max_batch=32, isolate=true)")


def test_one_gpu_passes_references_between_its_stages():
    kinds = _kinds(run_until("plan_buffers", "tts", devices="1xH200"))
    assert kinds["codec_lm.codes->decoder.codes"] == ("local", "")  # one process on cuda:0


def test_two_processes_on_one_gpu_share_a_device_ring():
    graph = run_until("plan_buffers", isolated_decoder_tts(), devices="1xH200")
    kinds = _kinds(graph)
    # the decoder asked for a process of its own: two processes on cuda:0
    assert kinds["codec_lm.codes->decoder.codes"] == ("cuda-ipc", "cuda:0")
    assert kinds["decoder.audio->audio.in"] == ("shm", "")
    device_ring = next(e for e in graph.edges if e.name == "codec_lm.codes->decoder.codes")
    # a device ring is not host shared memory
    host = sum(e.meta["channel"].ring_bytes for e in graph.edges if e is not device_ring)
    assert graph.meta["shm_bytes"] == host


def test_cpu_keeps_every_crossing_edge_on_host_rings():
    kinds = _kinds(run_until("plan_buffers", "tts", devices="cpu"))
    assert {k for k, _ in kinds.values()} == {"shm"}


def _budgets(graph) -> dict[str, int]:
    return {n.name: n.meta["placement"].budget for n in graph.stages}


def test_a_device_ring_comes_out_of_its_consumers_budget():
    before = _budgets(run_until("place", "omni_chat", devices="2xH200"))
    graph = run_until("plan_buffers", "omni_chat", devices="2xH200")
    ring = next(e for e in graph.edges if e.name == "talker.codes->code2wav.codes")
    assert ring.meta["channel"].device == "cuda:1"
    after = _budgets(graph)
    assert after["code2wav"] == before["code2wav"] - ring.meta["channel"].ring_bytes
    # the other stages on cuda:1 keep theirs (the towers' rings are in the thinker's GPU)
    assert [after[s] for s in ("hearing", "vision")] == [before[s] for s in ("hearing", "vision")]


def test_a_consumer_without_room_leaves_its_device_ring_to_the_roomiest_budget():
    # The isolated decoder has no KV cache: its GPU's slack went to the codec LM's (its budget
    # is its estimate and its stream's library workspace).
    source = isolated_decoder_tts()
    placed = run_until("place", source, devices="1xH200")
    before = _budgets(placed)
    workspace = Target(()).stream_workspace
    assert before["decoder"] == placed.node("decoder").meta["cost"].need + workspace
    graph = run_until("plan_buffers", source, devices="1xH200")
    ring = next(e for e in graph.edges if e.name == "codec_lm.codes->decoder.codes")
    after = _budgets(graph)
    assert after == {**before, "codec_lm": before["codec_lm"] - ring.meta["channel"].ring_bytes}


def test_a_stage_that_passes_requests_once_has_room_for_every_request_served_at_once():
    """Qwen3-TTS with its voice encoder batching 4: the talker holds 64 requests (rows of
    its KV cache), so the pipeline serves 64 at once (an encoder holds none beyond its
    step), and the voice encoder's input ring has a slot for each one's reference (a whole
    edge: one chunk a request), more than its own batch's credits (8)."""
    text = (GRAPHS / "qwen3_tts.omni").read_text()
    # (a CPU with room for the real-size talker's 64 slots of its prompt and max_tokens)
    source = text.replace("max_batch=8)", "max_batch=4)")
    graph = run_until("plan_buffers", source, devices="cpu=96GiB")
    batches = {n.name: graph.param_value(n, "max_batch") for n in graph.stages}
    assert batches["voice_encoder"] == 4 and batches["talker"] == 64
    assert requests_at_once((n.op, batches[n.name]) for n in graph.stages) == 64
    _, channel = _channel(graph, "ref_audio.out->voice_encoder.ref_audio")
    assert channel.slots == 64
    _, channel = _channel(graph, "voice_encoder.voice->voice_prompt.in")  # a client reads
    assert channel.slots == DEFAULT_CREDITS * 4


def test_requests_at_once_is_the_narrowest_batch_of_the_stages_that_hold_them():
    assert requests_at_once([("encoder", 4), ("diffusion", 6), ("vae", 2)]) == 6
    assert requests_at_once([("encoder", 4), ("vae", 2)]) == 2  # none holds: every stage
    assert requests_at_once([]) == 1


def _talker_into_decoder(talker: int, decoder: int) -> str:
    return (
        'pipeline p { model "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"\n'
        f' stage lm = ar(component="talker", max_batch={talker}, max_tokens=64)\n'
        f' stage dec = vocoder(component="code2wav", max_batch={decoder})\n'
        " input x: text -> lm\n lm.codes -> dec [stream]\n dec.audio -> output a }"
    )


def test_a_stage_feeding_a_narrower_one_is_said_to_leave_slots_empty():
    """A request holds a slot in both until it ends, so the decoder's 4 admit: the talker's
    other 4 never fill (on an H100 a Qwen3-Omni plan lowered so, code2wav 4 under a talker
    of 8, queued half of c=8 for whole requests, 5.8 s to first audio)."""
    graph = run_until("plan_buffers", _talker_into_decoder(8, 4))
    assert [w for w in graph.meta["warnings"] if "stay empty" in w] == [
        "stage 'lm' holds 8 requests, but 'dec' after it holds 4: the pipeline serves 4 at "
        "once; 4 slots of 'lm' stay empty"
    ]
    # A consumer wider than its producer is headroom for streams outliving their producer.
    for talker, decoder in ((4, 8), (4, 4)):
        graph = run_until("plan_buffers", _talker_into_decoder(talker, decoder))
        assert not [w for w in graph.meta["warnings"] if "stay empty" in w]

import math

from omniflow.compiler import compile_source
from omniflow.devices import parse_devices
from omniflow.passes.pipeline import Target
from omniflow.passes.size_chunks import MAX_STEADY, auto_schedule, step_seconds
from tests.gpu_wiring import stage_spec
from tests.passes.helpers import GRAPHS, run_until


def _schedule(graph, name):
    schedule = next(e for e in graph.edges if e.name == name).meta["schedule"]
    return list(schedule) if schedule is not None else None


def test_fixed_chunks_and_whole_edges():
    graph = run_until("size_chunks", "omni_chat")
    assert _schedule(graph, "thinker.hidden->talker.embeds") == [1]
    assert _schedule(graph, "prompt.out->thinker.prompt") is None
    assert _schedule(graph, "thinker.text->text.in") == [1]


def test_auto_ramps_from_a_small_first_chunk_to_a_steady_one():
    graph = run_until("size_chunks", "qwen3_tts")
    schedule = _schedule(graph, "talker.codes->code2wav.codes")
    assert schedule == sorted(schedule) and schedule[0] < schedule[-1]
    assert schedule[-1] <= MAX_STEADY
    assert all(b <= 2 * a for a, b in zip(schedule, schedule[1:], strict=False))


def _tts_ends(devices: str):
    """The target, and qwen3_tts's talker and code2wav as size_chunks sees them."""
    graph = run_until("size_chunks", "qwen3_tts", devices=devices)
    return Target(tuple(parse_devices(devices))), graph.node("talker"), graph.node("code2wav")


def test_a_decoder_that_re_decodes_context_gets_chunks_no_smaller_than_it():
    target, talker, code2wav = _tts_ends("2xH200")
    schedule = auto_schedule(target, talker, code2wav, 25)
    assert schedule[-1] >= 25 and schedule[0] >= auto_schedule(target, talker, code2wav, 0)[0]


def test_a_decoder_that_carries_state_sends_the_first_frame_alone():
    """Qwen3-TTS's code2wav carries each stream's state: its edge is marked so, needs no
    context, and on one H200 a frame is made and decoded in far less than its 80 ms of
    audio, so the first chunk is one frame (it was 2 with 25 frames of context)."""
    graph = run_until("size_chunks", "qwen3_tts", devices="1xH200")
    edge = next(e for e in graph.edges if e.name == "talker.codes->code2wav.codes")
    assert edge.meta["carries_state"] and edge.context == 0
    assert _schedule(graph, edge.name)[0] == 1
    assert not any(e.meta["carries_state"] for e in graph.edges if e is not edge)


def test_a_carried_states_first_chunk_follows_how_long_a_frame_plays():
    """The first chunk must play while the next, twice as long, is made and decoded."""
    target, talker, code2wav = _tts_ends("1xH200")
    step = step_seconds(target, talker)
    assert auto_schedule(target, talker, code2wav, 0, plays=0.08)[0] == 1
    assert auto_schedule(target, talker, code2wav, 0, plays=4 * step)[0] > 1
    # A producer slower than the audio plays: no first chunk keeps ahead; start steady.
    assert auto_schedule(target, talker, code2wav, 0, plays=step) == [MAX_STEADY]


def test_a_context_the_decoder_does_not_need_is_dropped_with_a_warning():
    source = (GRAPHS / "qwen3_tts.omni").read_text()
    source = source.replace("[stream, chunk=auto]", "[stream, chunk=auto, context=25]")
    plan = compile_source(source, "qwen3_tts.omni", devices="1xH200")
    channel = next(c for c in plan.channels if c.name == "talker.codes->code2wav.codes")
    assert channel.carries_state and channel.context == 0 and channel.schedule[0] == 1
    assert any("context=25 is not used" in w and "code2wav" in w for w in plan.warnings)


def test_a_carried_state_edge_says_how_long_a_step_plays_for_its_producer_to_pace_by():
    """On a GPU the talker's codes edge carries each frame's audio duration (80 ms at
    12.5 Hz): its writer paces chunks by it, the talker orders its rows by it and code2wav
    decodes what a paced chunk brings (runtime/slack.py); every other edge has none. On a
    CPU none does: its runs stay the same bits whatever their timing."""
    source = (GRAPHS / "qwen3_tts.omni").read_text()
    plan = compile_source(source, "qwen3_tts.omni", devices="1xH200")
    codes = next(c for c in plan.channels if c.name == "talker.codes->code2wav.codes")
    assert math.isclose(codes.plays_s, 0.08)
    assert all(c.plays_s is None for c in plan.channels if c is not codes)
    talker = stage_spec(plan, "talker")
    assert talker.plays == {"codes": codes.plays_s}
    code2wav = stage_spec(plan, "code2wav")
    assert code2wav.paced == {"codes": codes.plays_s}
    on_cpu = compile_source(source, "qwen3_tts.omni", devices="cpu=96GiB")  # room for it
    assert all(c.plays_s is None for c in on_cpu.channels)


def test_a_vocoder_streams_out_what_each_chunk_decodes():
    graph = run_until("size_chunks", "qwen3_tts")
    assert _schedule(graph, "code2wav.audio->audio.in") == _schedule(
        graph, "talker.codes->code2wav.codes"
    )


def test_a_block_grid_vocoder_gets_each_window_when_it_can_decode():
    # token2wav: 12-code DiT blocks, windows of 1, 2, 4, then 16 blocks; the shipped graph's
    # 12 codes of lookahead (Qwen's own streaming setting).
    graph = run_until("size_chunks", "omni_chat")
    assert _schedule(graph, "talker.codes->code2wav.codes") == [24, 24, 48, 192]
    assert _schedule(graph, "code2wav.audio->audio.in") == [12, 24, 48, 192]


def test_a_vocoders_lookahead_moves_its_first_window():
    source = (GRAPHS / "omni_chat.omni").read_text()
    assert ", lookahead=12)" in source
    # Unset, the decoder's reach: two blocks, its stream the whole-utterance decode.
    for whole in (source.replace(", lookahead=12)", ")"), source.replace("=12)", "=24)")):
        graph = run_until("size_chunks", whole)
        assert _schedule(graph, "talker.codes->code2wav.codes") == [36, 24, 48, 192]
        assert _schedule(graph, "code2wav.audio->audio.in") == [12, 24, 48, 192]


def test_a_slower_producer_allows_a_smaller_first_chunk():
    # A decoder that re-decodes 25 frames of context each chunk (the rule before a decoder
    # carried its state).
    gpu = auto_schedule(*_tts_ends("2xH200"), 25)
    slow = auto_schedule(*_tts_ends("2xA100"), 25)
    assert slow[0] <= gpu[0]


def test_explicit_lists_are_kept():
    src = (
        'pipeline p { model "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"\n stage lm = ar(component="talker")\n'
        ' stage dec = vocoder(component="code2wav")\n input x: text -> lm\n'
        " lm.codes -> dec [stream, chunk=[2, 10, 25], context=25]\n dec.audio -> output a }"
    )
    graph = run_until("size_chunks", src)
    assert _schedule(graph, "lm.codes->dec.codes") == [2, 10, 25]

from omniflow.passes.size_chunks import MAX_STEADY
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
    assert schedule[-1] >= 25  # no smaller than the left context it re-decodes
    assert schedule[-1] <= MAX_STEADY
    assert all(b <= 2 * a for a, b in zip(schedule, schedule[1:], strict=False))


def test_a_vocoder_streams_out_what_each_chunk_decodes():
    graph = run_until("size_chunks", "qwen3_tts")
    assert _schedule(graph, "code2wav.audio->audio.in") == _schedule(
        graph, "talker.codes->code2wav.codes"
    )


def test_a_block_grid_vocoder_gets_each_window_when_it_can_decode():
    # token2wav: 12-code DiT blocks, 24 codes of lookahead, windows of 1, 2, 4, then 16
    # blocks.
    graph = run_until("size_chunks", "omni_chat")
    assert _schedule(graph, "talker.codes->code2wav.codes") == [36, 24, 48, 192]
    assert _schedule(graph, "code2wav.audio->audio.in") == [12, 24, 48, 192]


def test_a_vocoders_lookahead_moves_its_windows_sooner():
    source = (GRAPHS / "omni_chat.omni").read_text()
    short = source.replace(
        'vocoder(component="token2wav",', 'vocoder(component="token2wav", lookahead=12,'
    )
    graph = run_until("size_chunks", short)
    assert _schedule(graph, "talker.codes->code2wav.codes") == [24, 24, 48, 192]
    assert _schedule(graph, "code2wav.audio->audio.in") == [12, 24, 48, 192]


def test_a_slower_producer_allows_a_smaller_first_chunk():
    gpu = _schedule(
        run_until("size_chunks", "qwen3_tts", devices="2xH200"), "talker.codes->code2wav.codes"
    )
    slow = _schedule(
        run_until("size_chunks", "qwen3_tts", devices="2xL4"), "talker.codes->code2wav.codes"
    )
    assert slow[0] <= gpu[0]


def test_explicit_lists_are_kept():
    src = (
        'pipeline p { model "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice"\n stage lm = ar(component="talker")\n'
        ' stage dec = vocoder(component="code2wav")\n input x: text -> lm\n'
        " lm.codes -> dec [stream, chunk=[2, 10, 25], context=25]\n dec.audio -> output a }"
    )
    graph = run_until("size_chunks", src)
    assert _schedule(graph, "lm.codes->dec.codes") == [2, 10, 25]

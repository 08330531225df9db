from tests.passes.helpers import run_until


def _executors(graph):
    return {x.name: x for x in graph.meta["executors"]}


def test_per_token_stream_on_one_device_is_fused():
    graph = run_until("fuse_stages", "omni_chat")
    executors = _executors(graph)
    # The towers' whole-output edges into the thinker keep them in executors of their own.
    assert set(executors) == {"hearing", "vision", "thinker+talker", "code2wav"}
    assert executors["thinker+talker"].stages == ("thinker", "talker")
    assert (
        "fused: thinker.hidden->talker.embeds streams chunk=1"
        in executors["thinker+talker"].reasons[0]
    )
    assert graph.node("prompt").meta["executor"] == "frontend"


def test_every_split_says_why():
    graph = run_until("fuse_stages", "omni_chat", devices="cuda:0=141GiB")
    executors = _executors(graph)
    assert set(executors) == {
        "hearing",
        "vision",
        "thinker+talker",
        "code2wav",
    }  # all on one device: the chunked and whole-output edges still split
    reasons = " ".join(executors["thinker+talker"].reasons)
    assert (
        "split from code2wav: talker.codes->code2wav.codes chunked stream (chunk=auto)" in reasons
    )


def test_whole_output_edges_stay_process_boundaries():
    graph = run_until("fuse_stages", "text_to_image", devices="cuda:0=141GiB")
    assert {x.name for x in graph.meta["executors"]} == {"encoder", "dit", "vae"}
    assert any("whole-output edge" in r for r in _executors(graph)["encoder"].reasons)

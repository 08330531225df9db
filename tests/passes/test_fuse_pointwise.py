from tests.passes.helpers import run_until


def test_chain_becomes_one_kernel_on_the_shrinking_side():
    graph = run_until("fuse_pointwise", "omni_chat")
    edge = next(e for e in graph.edges if e.maps)
    fused = edge.meta["pointwise"]
    assert fused.kernel == "fused_gain_clamp_pcm16"
    assert fused.ops == (("gain", (0.9,)), ("clamp", (-1, 1)), ("pcm16", ()))
    assert (fused.in_dtype, fused.out_dtype) == ("float32", "int16")
    # int16 is half of float32: convert before the hop, in the vocoder's executor
    assert fused.runs_in == graph.node("code2wav").meta["executor"] != "frontend"


def test_edges_without_maps_get_no_kernel():
    graph = run_until("fuse_pointwise", "omni_chat")
    assert all("pointwise" not in e.meta for e in graph.edges if not e.maps)

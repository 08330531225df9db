from omniflow.devices import GiB
from tests.passes.helpers import run_until


def test_guidance_doubles_the_batch_on_the_companion_path():
    graph = run_until("estimate_costs", "text_to_image")
    assert graph.node("encoder").meta["batch"] == 32  # max_batch 16, x2 for the negative prompt
    assert graph.node("dit").meta["batch"] == 16
    assert graph.node("vae").meta["batch"] == 8  # after guidance: one latent per request


def test_need_is_weights_plus_kv_plus_activations():
    graph = run_until("estimate_costs", "omni_chat")
    thinker = graph.node("thinker").meta
    cost = thinker["cost"]
    assert thinker["need"] == cost.weight_bytes + cost.kv_cache_bytes + cost.activation_bytes
    # 32 sequences x 4096 tokens x (28 layers x 2 x 4 kv heads x 128 x 2 bytes)
    assert cost.kv_cache_bytes == 32 * 4096 * 28 * 2 * 4 * 128 * 2


def test_an_explicit_memory_budget_overrides_the_estimate():
    src = (
        'pipeline p { model "Qwen/Qwen2.5-0.5B-Instruct"\n stage lm = ar(memory="3GiB")\n'
        " input x: chat -> lm\n lm.text -> output t }"
    )
    assert run_until("estimate_costs", src).node("lm").meta["need"] == 3 * GiB

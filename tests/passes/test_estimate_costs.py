from omniflow.devices import GiB
from tests.passes.helpers import GRAPHS, run_until


def test_guidance_doubles_the_batch_on_the_companion_path():
    graph = run_until("estimate_costs", "text_to_image")
    # max_batch 16, x2 for the negative prompt
    assert graph.node("encoder").meta["cost"].batch == 32
    assert graph.node("dit").meta["cost"].batch == 16
    assert graph.node("vae").meta["cost"].batch == 8  # after guidance: one latent per request


def test_need_is_weights_plus_kv_plus_activations():
    graph = run_until("estimate_costs", "omni_chat")
    facts = graph.node("thinker").meta["cost"]
    cost = facts.cost
    assert facts.need == cost.weight_bytes + cost.kv_cache_bytes + cost.activation_bytes
    # 32 sequences x (a 4096-token prompt + its max_tokens) x (28 layers x 2 x 4 kv heads x
    # 128 x 2 bytes): the positions a slot of the static cache holds
    positions = 4096 + graph.param_value(graph.node("thinker"), "max_tokens")
    assert cost.kv_cache_bytes == 32 * positions * 28 * 2 * 4 * 128 * 2


def test_an_explicit_memory_budget_overrides_the_estimate():
    src = (
        'pipeline p { model "Qwen/Qwen2.5-0.5B-Instruct"\n stage lm = ar(memory="3GiB")\n'
        " input x: chat -> lm\n lm.text -> output t }"
    )
    assert run_until("estimate_costs", src).node("lm").meta["cost"].need == 3 * GiB


def test_a_python_stage_needs_what_its_memory_says_else_nothing():
    src = (
        'pipeline p {\n stage a = python(fn=m.f, memory="2GiB")\n stage b = python(fn=m.f)\n'
        " input x: tokens -> a\n a.out -> b\n b.out -> output y }"
    )
    graph = run_until("estimate_costs", src)
    assert [graph.node(s).meta["cost"].need for s in "ab"] == [2 * GiB, 0]


def test_an_edit_pays_for_its_input_image():
    edit = run_until("estimate_costs", "image_edit")
    plain = run_until("estimate_costs", "text_to_image")
    dit, vae = edit.node("dit").meta["cost"].cost, plain.node("vae").meta["cost"].cost
    # The denoiser loads the VAE that encodes the input image beside the transformer...
    assert dit.params == plain.node("dit").meta["cost"].cost.params + vae.params
    assert dit.weight_bytes == plain.node("dit").meta["cost"].cost.weight_bytes + vae.weight_bytes
    # ... and 8 requests' conditional and unconditional rows attend over 64 x 64 output
    # tokens, up to 4920 input-image tokens and all 1675 + 1024 the encoder can send.
    assert dit.activation_bytes == 16 * (4096 + 4920 + 1675 + 1024) * 14 * 3072 * 2
    # The text encoder's sequence holds the image's tokens too.
    encoder = edit.node("encoder").meta["cost"].cost.activation_bytes
    assert encoder * 1024 == plain.node("encoder").meta["cost"].cost.activation_bytes * (
        1675 + 1024
    )


def test_a_video_vae_holds_one_latent_frames_outputs_at_a_time():
    # Wan's VAE decodes a latent frame at a time: a video four times as long costs its DiT
    # four times the tokens, its VAE no more activations.
    text = (GRAPHS / "text_to_video.omni").read_text(encoding="utf-8")
    costs = {
        frames: run_until(
            "estimate_costs", text.replace("num_frames = 81", f"num_frames = {frames}")
        )
        for frames in (81, 321)
    }
    vae = {f: g.node("vae").meta["cost"].cost.activation_bytes for f, g in costs.items()}
    dit = {f: g.node("dit").meta["cost"].cost.activation_bytes for f, g in costs.items()}
    assert vae[81] == vae[321] > 0
    assert dit[321] > 3 * dit[81]
    # 2 requests x 4 video frames of 480 x 832 pixels x 96 channels x 4 buffers, in bf16
    assert vae[81] == 2 * 4 * 480 * 832 * 96 * 4 * 2

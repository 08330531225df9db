import pytest

from omniflow.errors import PassError
from omniflow.ir.types import TensorSpec
from tests.passes.helpers import GRAPHS, run_until


def _edge(graph, name):
    return next(e for e in graph.edges if e.name == name)


def test_ar_ports_take_their_dims_from_the_model_config():
    graph = run_until("infer_types", "omni_chat")
    out = graph.node("thinker").meta["ports"].out
    # Per position: hidden state, input embedding and role, for the talker's adapter; the
    # prompt's positions stream too (max_len 4096 + max_tokens 2048).
    assert out["hidden"].step == TensorSpec("bfloat16", (3, 3584))
    assert out["hidden"].max_steps == 4096 + 2048
    assert out["tokens"].step == TensorSpec("int64", (1,))
    assert graph.node("talker").meta["ports"].out["hidden"].step == TensorSpec("bfloat16", (1, 896))
    assert graph.node("talker").meta["ports"].out["tokens"].max_steps == 4096  # $max_audio_tokens


def test_map_chain_changes_the_item_dtype():
    graph = run_until("infer_types", "omni_chat")
    edge = _edge(graph, "code2wav.audio->audio.in")
    assert graph.node("code2wav").meta["ports"].out["audio"].step.dtype == "float32"
    assert edge.meta["item"].item.dtype == "int16"
    assert (
        edge.meta["item"].item.shape == graph.node("code2wav").meta["ports"].out["audio"].step.shape
    )


def test_image_shapes_follow_height_width_and_vae_scale():
    graph = run_until("infer_types", "text_to_image")
    latents = _edge(graph, "dit.latents->vae.latents").meta["item"].item
    image = _edge(graph, "vae.image->image.in").meta["item"].item
    assert latents.shape == (16, 128, 128)
    assert image == TensorSpec("uint8", (1024, 1024, 3))


def test_codec_frames_carry_every_codebook():
    graph = run_until("infer_types", "qwen3_tts")
    assert _edge(graph, "talker.codes->code2wav.codes").meta["item"].item == TensorSpec(
        "int64", (16,)
    )


def test_audio_outputs_take_the_sample_rate_of_their_vocoder():
    # token2wav's config does not state its rate (the catalog knows it: 24 kHz); Qwen3-TTS's
    # speech tokenizer config does (output_sample_rate). Neither program writes rate=.
    for example in ("omni_chat", "qwen3_tts"):
        graph = run_until("infer_types", example)
        assert "rate" not in graph.node("audio").params
        assert graph.node("audio").meta["attrs"].attrs == {"rate": 24000}
    assert graph.node("talker").meta["ports"].out  # stages keep their port specs
    assert run_until("infer_types", "omni_chat").node("text").meta["attrs"].attrs == {}


def test_a_written_rate_must_be_the_vocoders():
    source = (GRAPHS / "tts.omni").read_text()
    agreeing = source.replace("output audio [stream]", "output audio [stream, rate=24000]")
    assert run_until("infer_types", agreeing).node("audio").meta["attrs"].attrs == {"rate": 24000}
    wrong = source.replace("output audio [stream]", "output audio [stream, rate=16000]")
    with pytest.raises(PassError, match="pass 'infer_types'") as info:
        run_until("infer_types", wrong)
    message = str(info.value)
    assert "output 'audio' says rate=16000, but stage 'decoder'" in message
    assert "makes 24000 Hz audio" in message


def test_an_edit_encoder_keeps_the_input_images_tokens():
    graph = run_until("infer_types", "image_edit")
    # A length header, the most tokens the pipeline's input image makes, then max_len.
    hidden = _edge(graph, "encoder.hidden->dit.cond").meta["item"].item
    assert hidden == TensorSpec("bfloat16", (1 + 1675 + 1024, 3584))
    assert _edge(graph, "dit.latents->vae.latents").meta["item"].item.shape == (16, 128, 128)
    assert _edge(graph, "image.out->dit.image").meta["item"].item == TensorSpec(
        "uint8", (1024, 1024, 3)
    )


def test_a_stage_takes_an_image_exactly_when_its_model_is_conditioned_on_one():
    source = (GRAPHS / "text_to_image.omni").read_text()
    with_image = source.replace(
        "  input negative_prompt", "  input photo: image -> dit.image\n  input negative_prompt"
    )
    with pytest.raises(PassError, match="pass 'infer_types'") as info:
        run_until("infer_types", with_image)
    message = str(info.value)
    assert "stage 'dit': Qwen/Qwen-Image [transformer] is not conditioned on an input" in message
    assert "leave its image port unconnected" in message
    source = (GRAPHS / "image_edit.omni").read_text()
    without_image = source.replace("  image          -> dit.image\n", "")
    with pytest.raises(PassError) as info:
        run_until("infer_types", without_image)
    message = str(info.value)
    assert "stage 'dit': Qwen/Qwen-Image-Edit [transformer] is conditioned on an input" in message
    assert "connect one to its image port" in message

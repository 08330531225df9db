"""The Python graph API builds the same graphs as the .omni files, and reports errors at
the Python line that caused them."""

from pathlib import Path

import pytest

from omniflow import Pipeline, auto, param
from omniflow.compiler import load_graph
from omniflow.errors import GraphError

GRAPHS = Path(__file__).parents[2] / "graphs"


def omni_chat():
    p = Pipeline("omni_chat", model="Qwen/Qwen2.5-Omni-7B")
    p.param("max_tokens", 2048)
    p.param("max_audio_tokens", 4096)
    p.param("temperature", 0.0)
    for name, value in (("top_p", 1.0), ("top_k", -1), ("repetition_penalty", 1.0), ("stop", [])):
        p.param(name, value)
    p.param("audio_temperature", 0.9)
    for name, value in (
        ("audio_top_p", 0.8),
        ("audio_top_k", 40),
        ("audio_repetition_penalty", 1.05),
    ):
        p.param(name, value)
    p.param("speaker", "Chelsie")
    p.param("use_audio_in_video", False)
    knobs = ("top_p", "top_k", "repetition_penalty")
    hearing = p.stage("hearing", "encoder", component="audio_tower", max_batch=32, max_len=1536)
    vision = p.stage("vision", "encoder", component="visual", max_batch=32, max_len=4096)
    thinker = p.stage(
        "thinker",
        "ar",
        component="thinker",
        max_batch=32,
        max_tokens=param("max_tokens"),
        temperature=param("temperature"),
        **{k: param(k) for k in knobs},
        stop=param("stop"),
        use_audio_in_video=param("use_audio_in_video"),
    )
    speaker = param("speaker")
    talker = p.stage(
        "talker",
        "ar",
        component="talker",
        max_batch=32,
        max_tokens=param("max_audio_tokens"),
        temperature=param("audio_temperature"),
        **{k: param(f"audio_{k}") for k in knobs},
        speaker=speaker,
    )
    code2wav = p.stage(
        "code2wav",
        "vocoder",
        component="token2wav",
        max_batch=64,
        speaker=speaker,
        lookahead=12,
    )
    p.flow(p.input("prompt", "chat"), thinker)
    p.flow(p.input("input_audio", "audio", optional=True), hearing)
    p.flow(p.input("image", "image", optional=True), vision.image)
    p.flow(p.input("video", "video", optional=True), vision.video)
    p.flow(hearing.hidden, thinker.audio_embeds)
    p.flow(vision.hidden, thinker.embeds)
    p.flow(thinker.hidden, talker, stream=True, chunk=1, adapter="qwen_omni.thinker_to_talker")
    p.flow(
        talker.codes,
        code2wav,
        stream=True,
        chunk=auto,
        context=25,
        adapter="qwen_omni.talker_to_code2wav",
    )
    p.flow(
        code2wav.audio,
        p.output("audio"),
        maps=[("gain", 0.9), ("clamp", -1, 1), "pcm16"],
        stream=True,
    )
    p.flow(thinker.text, p.output("text"), stream=True)
    return p


def tts():
    p = Pipeline("tts", model="tiny:tts")
    max_tokens = p.param("max_tokens", 2048)
    lm = p.stage("codec_lm", "ar", component="talker", max_batch=16, max_tokens=max_tokens)
    decoder = p.stage("decoder", "vocoder", component="code2wav", max_batch=32)
    p.flow(p.input("text", "text"), lm)
    p.flow(p.input("voice", "text", default="Vivian"), lm.voice)
    p.flow(lm.codes, decoder, stream=True, chunk=auto, context=25)
    p.flow(decoder.audio, p.output("audio"), maps=[("clamp", -1, 1), "pcm16"], stream=True)
    return p


def qwen_image_knobs(p: Pipeline) -> tuple[dict, dict, dict]:
    """The diffusion and VAE stages' knobs of the Qwen-Image graphs, declared on `p`."""
    steps, cfg_scale = p.param("steps", 50), p.param("true_cfg_scale", 4.0)
    distilled = p.param("guidance_scale", 1.0)
    height, width = p.param("height", 1024), p.param("width", 1024)
    cache = p.param("cache_threshold", 0.0)
    tiling, slicing = p.param("vae_use_tiling", False), p.param("vae_use_slicing", False)
    dit = {"steps": steps, "true_cfg_scale": cfg_scale, "guidance_scale": distilled}
    where = {"height": height, "width": width, "seed": param("seed"), "cache_threshold": cache}
    return dit, where, {"vae_use_tiling": tiling, "vae_use_slicing": slicing}


def qwen_image_stages(p: Pipeline):
    """The Qwen-Image graphs' text encoder, denoiser (its knobs, CFG on a negative prompt)
    and VAE, declared on `p` in the graphs' order."""
    knobs, where, vae_knobs = qwen_image_knobs(p)
    encoder = p.stage("encoder", "encoder", component="text_encoder", max_batch=16)
    negative = p.input("negative_prompt", "text", default="")
    # the request's own seed (`param("seed")`): no declaration needed
    dit = p.stage(
        "dit", "diffusion", component="transformer", max_batch=8, **knobs, cfg=negative, **where
    )
    vae = p.stage("vae", "vae", component="vae", max_batch=8, **vae_knobs)
    return encoder, dit, vae


def text_to_image():
    p = Pipeline("text_to_image", model="Qwen/Qwen-Image")
    encoder, dit, vae = qwen_image_stages(p)
    p.flow(p.input("prompt", "text"), encoder)
    p.flow(encoder.hidden, dit)
    p.flow(dit.latents, vae)
    p.flow(vae.image, p.output("image"), maps=["denorm", "to_uint8"])
    return p


def image_understanding():
    p = Pipeline("image_understanding", model="Qwen/Qwen2.5-VL-7B-Instruct")
    p.param("max_tokens", 512)
    knobs = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "stop": []}
    for name, value in knobs.items():
        p.param(name, value)
    vision = p.stage("vision", "encoder", component="visual", max_batch=16)
    llm = p.stage(
        "llm",
        "ar",
        component="language_model",
        max_batch=32,
        max_tokens=param("max_tokens"),
        **{k: param(k) for k in knobs},
    )
    p.flow(p.input("image", "image"), vision)
    p.flow(p.input("prompt", "chat"), llm)
    p.flow(vision.hidden, llm.embeds)
    p.flow(llm.text, p.output("text"), stream=True)
    return p


def image_edit():
    p = Pipeline("image_edit", model="Qwen/Qwen-Image-Edit")
    encoder, dit, vae = qwen_image_stages(p)
    image = p.input("image", "image")
    p.flow(image, encoder.image)
    p.flow(p.input("prompt", "text"), encoder.prompt)
    p.flow(image, dit.image)  # the denoiser encodes the input image itself
    p.flow(encoder.hidden, dit.cond)
    p.flow(dit.latents, vae)
    p.flow(vae.image, p.output("edited"), maps=["denorm", "to_uint8"])
    return p


@pytest.mark.parametrize(
    "make",
    [omni_chat, tts, text_to_image, image_understanding, image_edit],
    ids=lambda f: f.__name__,
)
def test_python_api_builds_the_same_graph(make):
    assert make().build() == load_graph(GRAPHS / f"{make.__name__}.omni")


def test_python_api_differences_are_seen():
    p = omni_chat()
    p.colocate(*(p.stage("extra", "ar"),))
    with pytest.raises(GraphError):
        p.build()


def test_python_api_errors_point_at_the_python_line():
    p = Pipeline("broken", model="Qwen/Qwen2.5-0.5B-Instruct")
    lm = p.stage("lm", "ar")
    p.flow(p.input("prompt", "chat"), lm)
    p.flow(lm.txt, p.output("text"))  # the bad line
    with pytest.raises(GraphError) as info:
        p.build()
    err = info.value
    assert err.span.path == __file__
    assert "p.flow(lm.txt" in err.span.line_text
    assert "did you mean 'text'?" in err.render()

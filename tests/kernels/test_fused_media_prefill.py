"""The fused static prefill of a prompt with media (multimodal RoPE positions, 3-D),
interpreted on the CPU: the tiny Qwen2.5-Omni thinker, given an audio clip's and an image's
embeddings from its own towers, prefills them straight into their slots beside a text
prompt, with the keys and values and the greedy tokens of the model's forward."""

import torch

from omniflow.backends.static_decode import StaticDecoder
from omniflow.backends.transformers_ar import TransformersAR
from omniflow.backends.vision import pack_media
from omniflow.catalog.resolve import model_path
from omniflow.compiler import compile_source
from omniflow.families.qwen2_5_omni import towers
from omniflow.runtime.stage import Call, InputStream
from tests.backends.test_transformers_ar import forward_shapes, run
from tests.families import media_inputs as media
from tests.gpu_wiring import stage_spec

MODEL = "tiny:qwen2.5-omni"
SOURCE = f"""
pipeline chat {{
  model "{MODEL}"
  stage lm = ar(component="thinker", max_batch=4, max_tokens=6, temperature=0.0, decode="static")
  input prompt: chat -> lm
  input input_audio: hidden? -> lm.audio_embeds
  input image: hidden? -> lm.embeds
  lm.tokens -> output tokens [stream]
}}
"""


def _media_value(kind: str, value) -> torch.Tensor:
    """A `hidden` value of one item through the thinker's own tower, as its stage emits."""
    path = str(model_path(MODEL))
    tower = towers.load(path, "audio_tower" if kind == "audio" else "visual", torch.float32)
    items = tower.forward(kind, [tower.prepare(kind, value)])
    return pack_media(items, tower.width, tower.dtype)


def _calls() -> list[Call]:
    """An image turn, an audio turn, a text turn: one prefill of three prompts (inputs by
    the stage's ports)."""
    chats = [
        (media.user({"type": "image"}), {"embeds": _media_value("image", media.image(1, 56, 84))}),
        (media.user({"type": "audio"}), {"audio_embeds": _media_value("audio", media.audio(1.5, 440.0))}),
        (media.user(text="Tell me a short story."), {}),
    ]  # fmt: skip
    calls = []
    for i, (chat, values) in enumerate(chats):
        inputs = {"prompt": InputStream("chat")}
        inputs["prompt"].push(chat, end=True)
        for port, value in values.items():
            inputs[port] = InputStream("hidden")
            inputs[port].push(value, end=True)
        calls.append(Call(f"r{i}", {"max_tokens": 6, "temperature": 0.0}, inputs))
    return calls


def prefilled(fused: bool) -> dict:
    torch.set_num_threads(1)
    plan = compile_source(SOURCE, devices="cpu")
    spec = stage_spec(plan, "lm")
    backend = TransformersAR(spec, "cpu")
    static = backend.static
    backend.static = StaticDecoder(
        backend.component, slots=static.slots, columns=static.columns, device="cpu",
        capture=False, extra=static.has_extra, fused=fused,
    )  # fmt: skip
    calls = _calls()
    with forward_shapes(backend.component.decoder) as forwards:
        backend.step(calls)
    static = backend.static
    slots = [(s.call.request_id, s.slot, s.length) for s in backend.rows]
    caches = [
        (static.keys[:, i, :, :n].clone(), static.values[:, i, :, :n].clone()) for _, i, n in slots
    ]
    outputs = run(backend, calls)
    assert all(call.error is None for call in calls), [call.error for call in calls]
    return {
        "forwards": forwards,
        "takes_positions": static.takes_positions,
        "slots": slots,
        "caches": caches,
        "tokens": [o.tokens for o in outputs],
    }


def test_a_media_prompt_is_prefilled_on_the_fused_layers(interpret):
    want, got = prefilled(False), interpret(prefilled, True)
    assert got["takes_positions"]
    assert [rows for rows, _ in want["forwards"]] == [3] and got["forwards"] == []
    assert got["slots"] == want["slots"]
    for mine, theirs in zip(got["caches"], want["caches"], strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert got["tokens"] == want["tokens"] and all(len(t) == 6 for t in got["tokens"])

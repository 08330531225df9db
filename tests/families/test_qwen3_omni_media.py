"""Omni input on Qwen3-Omni: images, audio and video into its thinker through its own towers
as encoder stages (tiny:qwen3-omni), against the unsplit model's own
`Qwen3OmniMoeForConditionalGeneration.generate` on the same processed inputs, greedy: the
thinker's text tokens (`return_audio=False`) and the talker's frames (all 16 codebooks).

The reference's inputs are what `Qwen3OmniMoeProcessor` makes (it cannot be constructed
without torchvision, so its parts are called one by one): the image processor's patches
and grids, the Whisper feature extractor's features and attention mask with the
processor's own audio kwargs (`padding=True, truncation=False`), the video's patches
(`towers.video_patches`) with seconds per grid = 2 / the 2 fps they were sampled at, the
chat template with each placeholder expanded by the processor's rules (its audio token
count, and a video with its audio track through its own `replace_video_with_audio_token`);
`generate` then runs the towers (the vision tower's deepstack features into the thinker's
first layers), merges their embeddings and computes the 3-D positions itself.

Where `generate` cannot run, and what the reference does instead: with an audio clip beside
an image or a video, its talker's `get_rope_index` reads `config.audio_config.n_window`,
which the talker's config lacks (AttributeError in transformers 5.24); the reference gives
its talker config the thinker's audio config's `n_window`, as the talker stage does.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from omniflow.backends.vision import MEDIA_HEADER_COLUMNS
from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_source
from omniflow.families.qwen2_5_omni import towers as shared
from omniflow.families.qwen3_omni import towers
from omniflow.families.qwen3_omni.checkpoints import reference_generate
from omniflow.hf_logging import quiet
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from tests.families import media_inputs as media
from tests.families.media_inputs import expanded_ids, interleaver, vision_inputs
from tests.runtime.test_readback import land_late

torch.set_num_threads(1)

MAX_TOKENS = 8
TALKER_TOKENS = 5  # generate's talker_max_new_tokens = TALKER_TOKENS + 1 (test_qwen3_omni.py)
SOURCE = f"""
pipeline q3_media {{
  model "tiny:qwen3-omni"
  param max_tokens = {MAX_TOKENS}
  param use_audio_in_video = false
  stage hearing = encoder(component="audio_tower", max_batch=8, max_len=1536)
  stage vision  = encoder(component="visual", max_batch=8, max_len=4096)
  stage thinker = ar(component="thinker", max_batch=8, max_tokens=$max_tokens, temperature=0.0,
                     use_audio_in_video=$use_audio_in_video)
  stage talker  = ar(component="talker", max_batch=8, max_tokens={TALKER_TOKENS},
                     temperature=0.0)
  input prompt: chat -> thinker
  input input_audio: audio? -> hearing
  input image: image? -> vision.image
  input video: video? -> vision.video
  hearing.hidden -> thinker.audio_embeds
  vision.hidden -> thinker.embeds
  thinker.hidden -> talker [stream, chunk=1, adapter=qwen3_omni.thinker_to_talker]
  thinker.tokens -> output tokens [stream]
  thinker.text -> output text [stream]
  talker.codes -> output codes [stream, adapter=qwen3_omni.talker_to_code2wav]
}}
"""
PLACEHOLDERS = {"image": "<|image_pad|>", "audio": "<|audio_pad|>", "video": "<|video_pad|>"}


CASES = media.cases(32)  # merged patches of 32 px


@pytest.fixture(scope="module")
def path():
    return build_tiny("qwen3-omni")


@pytest.fixture(scope="module")
def model(path):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    with quiet():
        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def plan():
    return compile_source(SOURCE, devices="cpu")


@pytest.fixture(scope="module")
def interpreter(plan):
    return Interpreter(plan)


def processed(path, messages, media: dict, use_audio_in_video=False):
    """`Qwen3OmniMoeProcessor`'s input ids and model inputs for `messages` and `media`."""
    from transformers import AutoImageProcessor, AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        Qwen3OmniMoeProcessor,
        _get_feat_extract_output_lengths,
    )

    tokenizer = AutoTokenizer.from_pretrained(path)
    images = AutoImageProcessor.from_pretrained(path, backend="pil")  # as the towers
    listed = {k: v if isinstance(v, list) else [v] for k, v in media.items()}
    settings = shared.video_settings(path, towers.VIDEO_DEFAULTS)
    kwargs, counts = vision_inputs(listed, images, settings, shared.video_patches)
    if "input_audio" in listed:
        out = WhisperFeatureExtractor.from_pretrained(path)(
            [a.numpy() for a in listed["input_audio"]],
            return_tensors="pt",
            **Qwen3OmniMoeProcessor.audio_kwargs,
        )
        mask = out["attention_mask"]
        kwargs |= {"input_features": out["input_features"], "feature_attention_mask": mask}
        lengths = _get_feat_extract_output_lengths(mask.sum(-1), Qwen3OmniMoeProcessor.n_window)
        counts["audio"] = lengths.tolist()
    # The processor's own interleaving.
    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2),
        audio_bos_token="<|audio_start|>",
        audio_eos_token="<|audio_end|>",
        video_token=PLACEHOLDERS["video"],
        audio_token=PLACEHOLDERS["audio"],
    )
    interleave = interleaver(
        Qwen3OmniMoeProcessor,
        processor,
        kwargs,
        counts,
        position_id_per_seconds=Qwen3OmniMoeProcessor.position_id_per_seconds,
    )
    ids = expanded_ids(
        tokenizer, messages, PLACEHOLDERS, counts, interleave if use_audio_in_video else None
    )
    return ids, kwargs | {"attention_mask": torch.ones_like(ids)}


def reference_text(path, model, messages, media: dict, use_audio_in_video=False) -> list[int]:
    """The text ids of `generate(return_audio=False)` on the processor's inputs."""
    ids, kwargs = processed(path, messages, media, use_audio_in_video)
    with torch.inference_mode(), quiet():
        text = model.generate(
            ids,
            return_audio=False,
            use_audio_in_video=use_audio_in_video,
            thinker_max_new_tokens=MAX_TOKENS,
            thinker_eos_token_id=model.config.im_end_token_id,
            thinker_do_sample=False,
            **kwargs,
        )
    return text[0, ids.shape[1] :].tolist()


def reference(path, model, messages, media: dict, use_audio_in_video=False):
    """(`reference_text`, the talker's frames of `generate` on the same inputs)."""
    text = reference_text(path, model, messages, media, use_audio_in_video)
    ids, kwargs = processed(path, messages, media, use_audio_in_video)
    kwargs["use_audio_in_video"] = use_audio_in_video
    talker = model.talker.config
    both = "input_features" in kwargs and ("image_grid_thw" in kwargs or "video_grid_thw" in kwargs)
    if both:  # see the module's docstring
        talker.audio_config = model.config.thinker_config.audio_config
    try:
        spoken = reference_generate(
            path,
            messages,
            MAX_TOKENS,
            talker_max_new_tokens=TALKER_TOKENS + 1,
            model=model,
            input_ids=ids,
            **kwargs,
        )
    finally:
        if both:
            del talker.audio_config
    return text, spoken.codes


@pytest.fixture(scope="module")
def references(path, model):
    return {
        name: reference(path, model, chat, media, **params)
        for name, (chat, media, params) in CASES.items()
    }


def _run(run, name):
    chat, media, params = CASES[name]
    return run({"prompt": chat, **media}, params)


@pytest.mark.parametrize("name", list(CASES))
def test_tokens_and_frames_match_generate(interpreter, references, name):
    out = _run(interpreter.run, name)
    text_ids, codes = references[name]
    assert out["tokens"].reshape(-1).tolist() == text_ids
    assert torch.equal(out["codes"], codes)


@pytest.fixture(scope="module")
def static_interpreter():
    """The plan with the thinker and the talker on the static decode path (their MoE layers
    without host readback, the talker's frames inside its step; what CUDA captures)."""
    source = SOURCE.replace(
        "use_audio_in_video=$use_audio_in_video)",
        'use_audio_in_video=$use_audio_in_video, decode="static")',
    ).replace("temperature=0.0)\n", 'temperature=0.0, decode="static")\n')
    interpreter = Interpreter(compile_source(source, devices="cpu"))
    assert {interpreter.backends[s].decode for s in ("thinker", "talker")} == {"static"}
    return interpreter


def test_the_static_path_gives_generates_tokens_and_frames(static_interpreter, references):
    """Media prompts (3-D positions, deepstack features into a prefill that then joins its
    slot) decode on the static path as `generate` decodes them."""
    for name in CASES:
        out = _run(static_interpreter.run, name)
        text_ids, codes = references[name]
        assert out["tokens"].reshape(-1).tolist() == text_ids, name
        assert torch.equal(out["codes"], codes), name


def test_media_headers_are_read_once_landed(static_interpreter, references, monkeypatch):
    """On a GPU a thinker reads its media values' headers (what each item is and its
    integers) from a copy to the host made without waiting (one per request, `MediaThinker.
    can_start`), as the talker reads its prompt's markers: here every read-back lands three
    polls late, as a busy GPU's would, and the thinker starts each request once its headers
    are in: `generate`'s tokens and frames all the same."""
    held_back = land_late(monkeypatch)
    thinker = static_interpreter.backends["thinker"].component
    prompt = thinker.prompt

    def prompt_then_poll(call):  # a loop may poll between a request's start and its step
        started = prompt(call)
        assert thinker.in_flight() is False
        return started

    monkeypatch.setattr(thinker, "prompt", prompt_then_poll)
    for name in CASES:
        out = _run(static_interpreter.run, name)
        text_ids, codes = references[name]
        assert out["tokens"].reshape(-1).tolist() == text_ids, name
        assert torch.equal(out["codes"], codes), name
    headers = [c for c in held_back if c.value.shape[-1] == MEDIA_HEADER_COLUMNS]
    assert len(headers) == len(CASES), "not every request's media headers were held back"


def test_the_media_change_the_answer(references):
    """Guards against a reference that ignores its media: every case answers differently."""
    answers = [tuple(ids) for ids, _ in references.values()]
    assert len(set(answers)) == len(answers)


TEXT_ONLY = "Tell me a short story."


@pytest.fixture(scope="module")
def text_only(path, model):
    return reference_generate(
        path, TEXT_ONLY, MAX_TOKENS, talker_max_new_tokens=TALKER_TOKENS + 1, model=model
    )


def test_engine_batches_every_case_at_once(plan, references, text_only):
    """All cases at once in one engine, and a text-only request: the towers encode items of
    several requests in one forward, the thinker prefills them together (each prompt's
    deepstack features at its own row's image and video positions, the text prompt's
    positions beside the others' 3-D ones) and decodes them in one batch; the same tokens."""
    names = [*CASES, TEXT_ONLY]

    def run(name):
        return (
            engine.generate({"prompt": name}) if name == TEXT_ONLY else _run(engine.generate, name)
        )

    with Engine(plan, "inprocess") as engine, ThreadPoolExecutor(len(names)) as pool:
        outs = dict(zip(names, pool.map(run, names), strict=True))
    for name, out in outs.items():
        want = text_only.text_ids.tolist() if name == TEXT_ONLY else references[name][0]
        assert out["tokens"].reshape(-1).tolist() == want, name


def test_a_text_only_request_is_unchanged(interpreter, text_only):
    """No media: the towers do nothing and the thinker and talker answer as on a text-only
    pipeline, `generate`'s text and frames."""
    out = interpreter.run({"prompt": TEXT_ONLY})
    assert out["tokens"].reshape(-1).tolist() == text_only.text_ids.tolist()
    assert torch.equal(out["codes"], text_only.codes)


def test_media_the_chat_has_no_place_for_fail_the_request(interpreter):
    with pytest.raises(Exception, match="no place for"):
        interpreter.run({"prompt": "Hello", "image": media.image(0, 64, 64)})


# Items of each kind that batch unevenly: clips of a full chunk and of less, images of two
# grids, videos of two lengths.
TOWER_ITEMS = {
    "audio": ("audio_tower", [media.audio(5.0, 440.0), media.audio(0.7, 300.0)]),
    "image": ("visual", [media.image(0, 64, 96), media.image(1, 96, 64)]),
    "video": ("visual", [media.frames(4), media.frames(6)]),
}


@torch.inference_mode()  # as the encoder stage runs it
def encoded(path, kind: str, device: str) -> list:
    """TOWER_ITEMS' values of `kind` encoded by their tower moved onto `device`."""
    component, values = TOWER_ITEMS[kind]
    tower = towers.load(str(path), component, torch.float32)
    tower.to(device)
    return tower.forward(kind, [tower.prepare(kind, value) for value in values])


@pytest.mark.parametrize("kind", TOWER_ITEMS)
def test_the_towers_items_fit_the_plans_edges(path, plan, kind):
    """What the GPU test encodes, on the CPU: an item per value, `meta[0]` rows each, as wide
    as the plan's edge from its stage to the thinker."""
    stage = "hearing" if kind == "audio" else "vision"
    edge = next(c for c in plan.channels if c.src == stage and c.dst == "thinker")
    items = encoded(path, kind, "cpu")
    assert len(items) == len(TOWER_ITEMS[kind][1])
    for item in items:
        assert item.kind == kind and item.embeds.shape == (item.meta[0], edge.item_shape[1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", TOWER_ITEMS)
def test_on_cuda_the_towers_give_the_cpus_items(path, kind):
    """The encoder stages' towers moved onto CUDA (features, patches and grids included)
    encode each kind as on the CPU: the same integers, embeddings within float32 noise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for on_cpu, on_gpu in zip(encoded(path, kind, "cpu"), encoded(path, kind, "cuda"), strict=True):
        assert on_gpu.embeds.is_cuda and on_gpu.meta == on_cpu.meta
        scale = float(on_cpu.embeds.abs().max())
        torch.testing.assert_close(on_gpu.embeds.cpu(), on_cpu.embeds, atol=1e-3 * scale, rtol=0)


def one_gpu_plan():
    """The media plan compiled for one H200: every stage on cuda:0, one executor."""
    plan = compile_source(SOURCE, devices="1xH200")
    (executor,) = plan.executors
    assert executor.stage_names == ["hearing", "vision", "thinker", "talker"]
    assert {device for stage in plan.stages for device in stage.devices} == {"cuda:0"}
    return plan


def test_on_one_gpu_the_media_plan_is_one_executor():
    """The GPU test's plan, compiled here: its wiring breaks on any machine."""
    one_gpu_plan()


@pytest.mark.gpu
def test_on_one_gpu_media_go_through_the_one_executor_plan():
    """Image, audio and video input through the one-GPU plan: the towers, the captured
    thinker (MoE) and talker steps in one executor process, each stage on its own stream,
    hand-offs ordered by CUDA events, give each case the frames the same executor gives
    with its stages on one stream in program order, and the tokens the interpreter gives
    (which runs every stage on the CPU: its frames, float32 on other kernels, differ from
    the GPU's on three of the five cases, measured on an H200; its greedy tokens do not)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    plan = one_gpu_plan()
    interpreter = Interpreter(plan)
    want = {name: _run(interpreter.run, name) for name in CASES}
    one_stream = dataclasses.replace(
        plan, programs=[dataclasses.replace(p, stream_priorities={}) for p in plan.programs]
    )
    with Engine(one_stream, "process") as engine:
        in_order = {name: _run(engine.generate, name) for name in CASES}
    with Engine(plan, "process") as engine:
        for name in CASES:
            out = _run(engine.generate, name)
            assert out["tokens"].reshape(-1).tolist() == want[name]["tokens"].reshape(-1).tolist()
            assert len(out["codes"]) and torch.equal(out["codes"], in_order[name]["codes"])

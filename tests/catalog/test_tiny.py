"""Tests of omniflow.checkpoints.tiny: the tiny offline checkpoints and their references.

Each checkpoint is built once into a temporary cache, then loaded through the
ordinary from_pretrained paths (AutoConfig, AutoModel*, AutoTokenizer, DiffusionPipeline)
and run. Outputs are compared across two independent loads, so any unseeded or
train-mode randomness shows up as a mismatch.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from omniflow import families
from omniflow.checkpoints.tiny import (
    MANIFEST,
    build_tiny,
    is_complete,
    list_tiny,
    tiny_cache_dir,
)
from omniflow.checkpoints.tiny_recipes import portable_uniform
from omniflow.families.codec_tts.checkpoints import read_tts_index, reference_tts
from omniflow.families.qwen2_5_omni.checkpoints import omni_prompt_ids, reference_omni_generate
from omniflow.families.qwen2_5_vl.checkpoints import reference_vl_generate
from omniflow.hf_logging import quiet

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.timeout(120)

PROMPT = "Tell me a short story about a robot who learns to sing."


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Run single-threaded: these models are too small to gain from threads, and while
    other processes keep a 2-core machine busy, torch's spinning worker threads made this
    file ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This module's OMNIFLOW_CACHE, so no test touches the user's cache."""
    root = tmp_path_factory.mktemp("omniflow_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMNIFLOW_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def built(cache):
    """name -> checkpoint directory, each built once for this module."""
    return {name: build_tiny(name) for name in list_tiny()}


def _load_twice(load):
    with quiet():
        return load(), load()


def _manifest(directory):
    return json.loads((directory / MANIFEST).read_text())


# --- building and the cache -------------------------------------------------------------


def test_registry_names_every_required_model():
    assert {"qwen2.5-omni", "qwen2", "qwen2.5-vl", "text-to-image", "tts"} <= set(list_tiny())
    models = families.tiny_models()
    assert list_tiny() == sorted(models)
    assert all(m.description and "\n" not in m.description for m in models.values())
    with pytest.raises(KeyError, match="did you mean 'qwen2'"):
        build_tiny("qwen3")


def test_builds_into_the_cache_and_reuses_it(cache, built):
    directory = built["qwen2"]
    assert directory == tiny_cache_dir() / "qwen2" and directory.is_relative_to(cache / "tiny")
    assert is_complete(directory, "qwen2")
    before = {p: p.stat().st_mtime_ns for p in directory.rglob("*")}
    start = time.perf_counter()
    assert build_tiny("qwen2") == directory
    assert time.perf_counter() - start < 1.0
    assert {p: p.stat().st_mtime_ns for p in directory.rglob("*")} == before


@pytest.mark.parametrize(
    "name", ["qwen2", "qwen2.5-omni", "qwen2.5-vl", "text-to-image", "image-edit", "tts"]
)
def test_rebuilding_gives_identical_bytes(built, tmp_path, name):
    again = build_tiny(name, tmp_path / name)
    assert _manifest(again)["files"] == _manifest(built[name])["files"]
    sizes = [entry["bytes"] for entry in _manifest(again)["files"].values()]
    assert sum(sizes) < 5_000_000


def test_an_interrupted_build_is_rebuilt(tmp_path):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(finished.stdout)
    abandoned = tmp_path / f".qwen2.tmp-{dead_pid}-0000"
    abandoned.mkdir()
    (abandoned / "config.json").write_text("{}")
    in_progress = tmp_path / f".qwen2.tmp-{os.getpid()}-1111"
    in_progress.mkdir()

    directory = build_tiny("qwen2", tmp_path / "qwen2")
    assert is_complete(directory, "qwen2")
    assert not abandoned.exists(), "a dead builder's temp dir is cleaned up"
    assert in_progress.exists(), "a live builder's temp dir is left alone"


def test_a_directory_without_manifest_is_replaced(tmp_path):
    directory = tmp_path / "qwen2"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    assert not is_complete(directory, "qwen2")
    assert build_tiny("qwen2", directory) == directory
    assert is_complete(directory, "qwen2")
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2"


def test_a_truncated_file_makes_the_build_incomplete(tmp_path):
    directory = build_tiny("qwen2", tmp_path / "qwen2")
    with (directory / "model.safetensors").open("r+b") as f:
        f.truncate(100)
    assert not is_complete(directory, "qwen2")


def test_progress_bar_is_drawn_on_stderr(tmp_path, capsys):
    build_tiny("qwen2", tmp_path / "qwen2", progress=True)
    out, err = capsys.readouterr()
    assert "tiny qwen2" in err and not out  # stdout stays for what a script reads


def test_a_first_use_build_says_what_it_builds_and_how_long_it_took(tmp_path):
    """A server's first start on --tiny builds its models while it compiles its graphs:
    stderr says so, a line as the build starts and one with its time and size, and a second
    start, reusing the build, says nothing of it. (`omniflow compile`: the same code path,
    without the server.)"""
    env = {**os.environ, "OMNIFLOW_CACHE": str(tmp_path / "cache")}
    argv = [sys.executable, "-P", "-m", "omniflow.cli", "compile", "graphs/tts.omni", "--tiny"]
    runs = [
        subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        for _ in range(2)
    ]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    first = runs[0].stderr.splitlines()
    assert "omniflow: building tiny tts (first use) ..." in first
    (done,) = [line for line in first if line.startswith("omniflow: built tiny tts in ")]
    folder = tmp_path / "cache" / "tiny" / tiny_cache_dir().name / "tts"  # by library versions
    assert re.fullmatch(rf"omniflow: built tiny tts in [\d.]+ s \([\d.]+ MB\): {folder}", done)
    assert "pipeline tts" in runs[0].stdout  # the plan, on stdout alone
    assert "building" not in runs[1].stderr and "built" not in runs[1].stderr


def test_portable_weights_are_pinned():
    # The generator's bits are part of the checkpoint format: these must never change.
    values = portable_uniform("omniflow", (4,), 1.0)
    assert values.dtype == torch.float32
    assert values.tolist() == [
        -0.9683395624160767,
        -0.3467040956020355,
        0.7080780267715454,
        0.18770906329154968,
    ]


# --- qwen2 ------------------------------------------------------------------------------


def test_qwen2_loads_and_generates_identically(built):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

    directory = built["qwen2"]
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert config.model_type == "qwen2" and len(tokenizer) <= config.vocab_size
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).input_ids
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")

    first, second = _load_twice(lambda: AutoModelForCausalLM.from_pretrained(directory))
    assert isinstance(first, Qwen2ForCausalLM)
    assert not any(module.training for module in first.modules())
    with torch.no_grad():
        logits = first(ids).logits
        outputs = [m.generate(ids, max_new_tokens=12) for m in (first, second)]
    assert logits.shape == (1, ids.shape[1], config.vocab_size) and logits.dtype == torch.float32
    assert torch.equal(outputs[0], outputs[1])
    new = outputs[0][0, ids.shape[1] :]
    assert len(new) > 0 and int(new.max()) < len(tokenizer)


# --- qwen2.5-omni -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def omni(built):
    """(directory, model, tokenizer) of the omni checkpoint, loaded through the auto classes."""
    from transformers import AutoModelForTextToWaveform, AutoTokenizer

    directory = built["qwen2.5-omni"]
    with quiet():
        model = AutoModelForTextToWaveform.from_pretrained(directory)
    return directory, model, AutoTokenizer.from_pretrained(directory)


def test_omni_loads_through_the_auto_classes(omni):
    from transformers import AutoConfig, Qwen2_5OmniForConditionalGeneration

    directory, model, tokenizer = omni
    config = AutoConfig.from_pretrained(directory)
    assert config.model_type == "qwen2_5_omni"
    assert isinstance(model, Qwen2_5OmniForConditionalGeneration)
    assert set(model.speaker_map) == {"Chelsie", "Ethan"}
    assert not any(module.training for module in model.modules())
    assert model.token2wav.dtype == torch.float32
    assert len(tokenizer) <= config.thinker_config.text_config.vocab_size
    assert tokenizer.convert_tokens_to_ids("<|AUDIO|>") == config.thinker_config.audio_token_index


def test_omni_thinker_takes_audio_and_images(omni):
    from transformers import AutoFeatureExtractor

    directory, model, tokenizer = omni
    features = AutoFeatureExtractor.from_pretrained(directory)(
        [torch.zeros(16000).numpy()],
        sampling_rate=16000,
        return_attention_mask=True,
        return_tensors="pt",
    )
    tower = model.thinker.model.audio_tower
    audio_tokens = int(
        tower._get_feat_extract_output_lengths(features["attention_mask"].sum(-1))[1]
    )
    grid = torch.tensor([[1, 4, 4]])  # one frame pair of 4x4 patches: 4 tokens after 2x2 merge
    pixels = torch.linspace(-1, 1, 16 * 3 * 2 * 14 * 14).view(16, -1)
    content = [{"type": "audio"}, {"type": "image"}, {"type": "text", "text": "Hi"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    text = text.replace("<|AUDIO|>", "<|AUDIO|>" * audio_tokens)
    text = text.replace("<|IMAGE|>", "<|IMAGE|>" * 4)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        # The thinker checks that each tower's output fills its placeholders exactly.
        out = model.thinker(
            input_ids=ids,
            input_features=features["input_features"],
            feature_attention_mask=features["attention_mask"],
            pixel_values=pixels,
            image_grid_thw=grid,
            output_hidden_states=True,
        )
    text_config = model.config.thinker_config.text_config
    assert out.logits.shape == (1, ids.shape[1], text_config.vocab_size)
    assert out.hidden_states[-1].shape == (1, ids.shape[1], text_config.hidden_size)


def test_omni_token2wav_decodes_codes(omni):
    _, model, _ = omni
    speaker = model.speaker_map["Chelsie"]
    codes = torch.arange(10).view(1, -1)
    with torch.no_grad():
        torch.manual_seed(0)
        wave = model.token2wav(
            codes, conditioning=speaker["cond"].view(1, -1), reference_mel=speaker["ref_mel"]
        )
    # The DiT makes `repeats` (2) mel frames per code; BigVGAN 240 samples per frame.
    assert wave.shape == (10 * 2 * 240,) and wave.dtype == torch.float32


def test_reference_omni_generate_is_deterministic(built):
    directory = built["qwen2.5-omni"]
    first = reference_omni_generate(directory, PROMPT, max_new_tokens=8, talker_max_new_tokens=24)
    second = reference_omni_generate(directory, PROMPT, max_new_tokens=8, talker_max_new_tokens=24)
    assert first.text_ids.dtype == torch.int64 and len(first.text_ids) == 8
    assert first.text.strip()
    assert 0 < len(first.codec_ids) <= 24 and int(first.codec_ids.max()) < 128
    assert first.waveform.shape == (len(first.codec_ids) * 2 * 240,)
    assert first.waveform.dtype == torch.float32
    assert 0.05 < float(first.waveform.std()) < 0.9, "audible, not silent or clipped"
    assert torch.equal(first.text_ids, second.text_ids) and first.text == second.text
    assert torch.equal(first.codec_ids, second.codec_ids)
    torch.testing.assert_close(first.waveform, second.waveform, rtol=0, atol=0)
    # The talker is conditioned on the thinker's hidden states: another prompt, other codes.
    other = reference_omni_generate(directory, "Hello!", max_new_tokens=8, talker_max_new_tokens=24)
    assert not torch.equal(other.codec_ids, first.codec_ids)


def test_omni_prompt_uses_the_speaking_system_prompt(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built["qwen2.5-omni"])
    text = tokenizer.decode(omni_prompt_ids(tokenizer, "Hi")[0])
    assert text.startswith("<|im_start|>system\nYou are Qwen, a virtual human")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


# --- qwen2.5-vl -------------------------------------------------------------------------


def test_qwen_vl_loads_through_the_auto_classes(built):
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoModelForImageTextToText,
        AutoTokenizer,
        Qwen2_5_VLForConditionalGeneration,
    )

    directory = built["qwen2.5-vl"]
    config = AutoConfig.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    processor = AutoImageProcessor.from_pretrained(directory)
    assert config.model_type == "qwen2_5_vl"
    assert len(tokenizer) <= config.text_config.vocab_size
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>")}
    assert ids == {
        "<|vision_start|>": config.vision_start_token_id,
        "<|image_pad|>": config.image_token_id,
    }
    content = [{"type": "image"}, {"type": "text", "text": "Hi"}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    assert "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>" in text
    # The real checkpoint's patching and size limits (min_pixels, max_pixels).
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (14, 2, 2)
    assert (processor.size["shortest_edge"], processor.size["longest_edge"]) == (3136, 12845056)
    with quiet():
        model = AutoModelForImageTextToText.from_pretrained(directory)
    assert isinstance(model, Qwen2_5_VLForConditionalGeneration)
    assert not any(module.training for module in model.modules())
    assert sum(p.numel() for p in model.parameters()) == 248_032
    assert sum(p.numel() for p in model.model.visual.parameters()) == 83_616


def test_reference_vl_generate_is_deterministic_and_sees_the_image(built):
    directory = built["qwen2.5-vl"]
    images = torch.randint(0, 256, (2, 56, 84, 3), generator=torch.Generator().manual_seed(0))
    image = images[0].to(torch.uint8)
    first = reference_vl_generate(directory, "What is this?", image, max_new_tokens=8)
    second = reference_vl_generate(directory, "What is this?", image, max_new_tokens=8)
    assert first.text_ids.dtype == torch.int64 and len(first.text_ids) == 8
    assert first.image_grid_thw.tolist() == [[1, 4, 6]]  # 56 x 84 px: 4 x 6 patches of 14
    assert torch.equal(first.text_ids, second.text_ids) and first.text == second.text
    other = reference_vl_generate(
        directory, "What is this?", images[1].to(torch.uint8), max_new_tokens=8
    )
    assert not torch.equal(other.text_ids, first.text_ids)


# --- text-to-image ----------------------------------------------------------------------


def test_text_to_image_pipeline_runs_identically(built):
    from diffusers import DiffusionPipeline, QwenImagePipeline

    directory = built["text-to-image"]
    index = json.loads((directory / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    pipes = _load_twice(lambda: DiffusionPipeline.from_pretrained(directory))
    images = []
    for pipe in pipes:
        assert isinstance(pipe, QwenImagePipeline)
        pipe.set_progress_bar_config(disable=True)
        images.append(
            pipe(
                "A photo of a red cat",
                negative_prompt=" ",
                true_cfg_scale=4.0,
                num_inference_steps=2,
                height=32,
                width=32,
                generator=torch.Generator().manual_seed(0),
                output_type="np",
            ).images
        )
    assert images[0].shape == (1, 32, 32, 3) and images[0].dtype == "float32"
    assert (images[0] == images[1]).all()
    assert float(images[0].std()) > 0.01 and images[0].min() >= 0.0 and images[0].max() <= 1.0

    # The pipeline drops the first 34 prompt-template tokens, as many as its system prefix.
    pipe = pipes[0]
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34


def test_image_edit_pipeline_loads_with_its_processor(built):
    """The edit pipeline loads as diffusers loads it, given the processor (its own loading
    needs torchvision); tests/backends/test_image_edit.py runs it."""
    from diffusers import DiffusionPipeline, QwenImageEditPipeline
    from PIL import Image

    from omniflow.families.qwen_image.pipeline import load_processor

    directory = built["image-edit"]
    index = json.loads((directory / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPipeline"
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    with quiet():
        pipe = DiffusionPipeline.from_pretrained(
            directory, processor=load_processor(directory / "processor")
        )
    assert isinstance(pipe, QwenImageEditPipeline)
    # The pipeline drops the first 64 prompt-template tokens: the system prefix and the
    # user turn's start, as many as with the real tokenizer; the image's tokens stay.
    prefix = pipe.prompt_template_encode.split("<|vision_start|>")[0]
    tokenizer = pipe.processor.tokenizer
    assert len(tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 64
    # The processor expands the image placeholder to one token per 28 x 28 pixels.
    inputs = pipe.processor(
        text=[pipe.prompt_template_encode.format("Make the cat blue.")],
        images=[Image.new("RGB", (84, 56))],
        return_tensors="pt",
    )
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == image_pad).sum()) == 6


# --- tts --------------------------------------------------------------------------------


def test_tts_parts_load_through_auto_classes(built):
    from transformers import (
        AutoModel,
        AutoModelForCausalLM,
        AutoTokenizer,
        DacModel,
        Qwen3ForCausalLM,
    )

    directory = built["tts"]
    index = read_tts_index(directory)
    with quiet():
        talker = AutoModelForCausalLM.from_pretrained(directory / "talker")
        code2wav = AutoModel.from_pretrained(directory / "code2wav")
    tokenizer = AutoTokenizer.from_pretrained(directory / index["tokenizer_subfolder"])
    assert isinstance(talker, Qwen3ForCausalLM) and isinstance(code2wav, DacModel)
    assert index["talker"] == ["transformers", "Qwen3ForCausalLM"]
    assert len(tokenizer) <= index["codec_token_offset"]
    assert index["codec_token_offset"] + index["codebook_size"] <= index["codec_bos_token_id"]
    assert code2wav.config.codebook_size == index["codebook_size"]
    assert code2wav.config.hop_length == index["samples_per_frame"]


def test_reference_tts_is_deterministic(built):
    directory = built["tts"]
    first = reference_tts(directory, "Good morning, and welcome to the show.", voice="Vivian")
    second = reference_tts(directory, "Good morning, and welcome to the show.", voice="Vivian")
    other_voice = reference_tts(directory, "Good morning, and welcome to the show.", voice="Ryan")
    frames = len(first.codes)
    assert first.codes.dtype == torch.int64 and frames > 0
    assert int(first.codes.min()) >= 0 and int(first.codes.max()) < 128
    assert first.waveform.shape == (frames * 1920,) and first.waveform.dtype == torch.float32
    assert 0.05 < float(first.waveform.std()) < 0.9
    assert torch.equal(first.codes, second.codes)
    torch.testing.assert_close(first.waveform, second.waveform, rtol=0, atol=0)
    assert not torch.equal(first.codes, other_voice.codes), "the voice conditions the codes"
    with pytest.raises(KeyError, match="unknown voice"):
        reference_tts(directory, "Hi", voice="Nobody")

"""Omni input: images, audio and video into Qwen2.5-Omni's thinker through its own towers as
encoder stages (`graphs/omni_chat.omni` on tiny:qwen2.5-omni), against the unsplit
thinker's own `generate` on the same processed inputs, greedy; and the talker speaking on
those prompts, against the whole model's `generate` (`reference_omni_generate`): its text
and the talker's codes, both greedy.

The reference's inputs are what `Qwen2_5OmniProcessor` makes (it cannot be constructed
without torchvision, so its parts are called one by one): the image processor's patches
and grids, the Whisper feature extractor's features and attention mask at 16 kHz, the
video's patches (`towers.video_patches`), the chat template with each placeholder expanded
by the processor's own rules (a video with its audio track through the processor's own
`replace_video_with_audio_token`); the thinker's `generate` then runs its towers, merges
their embeddings and computes TMRoPE itself.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_file
from omniflow.families.qwen2_5_omni import towers
from omniflow.hf_logging import quiet
from omniflow.runtime.engine import Engine
from omniflow.runtime.interpreter import Interpreter
from omniflow.runtime.requests import RequestError
from tests.families import media_inputs as media
from tests.families.media_inputs import expanded_ids, interleaver, vision_inputs

torch.set_num_threads(1)

GRAPH = Path(__file__).parents[2] / "graphs" / "omni_chat.omni"
MAX_TOKENS = 10
PARAMS = {"max_tokens": MAX_TOKENS, "max_audio_tokens": 4}


CASES = media.cases(28)  # merged patches of 28 px


@pytest.fixture(scope="module")
def path():
    return build_tiny("qwen2.5-omni")


@pytest.fixture(scope="module")
def plan():
    return compile_file(str(GRAPH), tiny=True)


def processed(path, messages, media: dict, use_audio_in_video=False):
    """`Qwen2_5OmniProcessor`'s input ids and model inputs for `messages` and `media`."""
    from transformers import (
        AutoConfig,
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2_5OmniProcessor,
        WhisperFeatureExtractor,
    )

    tokenizer = AutoTokenizer.from_pretrained(path)
    images = AutoImageProcessor.from_pretrained(path, backend="pil")  # as the towers
    extractor = WhisperFeatureExtractor.from_pretrained(path)
    config = AutoConfig.from_pretrained(path).thinker_config
    listed = {k: v if isinstance(v, list) else [v] for k, v in media.items()}
    settings = towers.video_settings(path)
    kwargs, counts = vision_inputs(listed, images, settings, towers.video_patches)
    kwargs["use_audio_in_video"] = use_audio_in_video
    if "input_audio" in listed:
        out = extractor(
            [a.numpy() for a in listed["input_audio"]],
            sampling_rate=16000,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        mask = out["attention_mask"]
        kwargs |= {"input_features": out["input_features"], "feature_attention_mask": mask}
        lengths = mask.sum(-1)
        counts["audio"] = (((lengths - 1) // 2 + 1 - 2) // 2 + 1).tolist()
    tokens = {"image": "<|IMAGE|>", "audio": "<|AUDIO|>", "video": "<|VIDEO|>"}
    # The processor's own interleaving.
    processor = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2),
        audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
        video_token="<|VIDEO|>",
        audio_token="<|AUDIO|>",
    )
    processor.get_chunked_index = functools.partial(
        Qwen2_5OmniProcessor.get_chunked_index, processor
    )
    interleave = interleaver(
        Qwen2_5OmniProcessor,
        processor,
        kwargs,
        counts,
        position_id_per_seconds=config.position_id_per_seconds,
        seconds_per_chunk=config.seconds_per_chunk,
    )
    ids = expanded_ids(
        tokenizer, messages, tokens, counts, interleave if use_audio_in_video else None
    )
    return ids, kwargs | {"attention_mask": torch.ones_like(ids)}


def reference(path, messages, media: dict, use_audio_in_video=False) -> list[int]:
    """The thinker's own `generate` on the processor's inputs for `messages` and `media`."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    with quiet():
        model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path).eval()
    ids, kwargs = processed(path, messages, media, use_audio_in_video)
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def references(path):
    return {
        name: reference(path, chat, media, **params)
        for name, (chat, media, params) in CASES.items()
    }


def _text(path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_matches_generate(plan, path, references, name):
    chat, media, params = CASES[name]
    out = Interpreter(plan).run({"prompt": chat, **media}, {**PARAMS, **params})
    assert out["text"] == _text(path, references[name])


# The talker made greedy (generate's `talker_do_sample=False`), its repetition penalty the
# pipeline's and generate's default (1.05), as tests/backends/test_omni_fidelity.py has it.
TALKER_TOKENS = 12
SPOKEN = {"audio_temperature": 0.0, "max_audio_tokens": TALKER_TOKENS}


@pytest.fixture(scope="module")
def spoken_plan():
    """graphs/omni_chat.omni with the talker's codes as an output too (as token2wav gets
    them), on tiny:qwen2.5-omni."""
    from omniflow.catalog.resolve import use_tiny_models
    from omniflow.compiler import compile_graph, graph_from_source

    text = GRAPH.read_text()
    end = text.rindex("}")
    codes = "  talker.codes -> output codes [stream, adapter=qwen_omni.talker_to_code2wav]\n"
    graph = graph_from_source(text[:end] + codes + text[end:], str(GRAPH))
    return compile_graph(use_tiny_models(graph), "cpu")


@pytest.fixture(scope="module")
def spoken(path):
    """Per case, the whole model's `generate` on the processor's inputs: its text and the
    talker's codes (`reference_omni_generate`)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    from omniflow.families.qwen2_5_omni.checkpoints import reference_omni_generate

    with quiet():
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path).eval()
    out = {}
    for name, (chat, items, params) in CASES.items():
        ids, kwargs = processed(path, chat, items, **params)
        out[name] = reference_omni_generate(
            path,
            None,
            MAX_TOKENS,
            talker_max_new_tokens=TALKER_TOKENS,
            model=model,
            input_ids=ids,
            token2wav_num_steps=1,
            **kwargs,
        )
    return out


def _spoken(run, name):
    chat, media, params = CASES[name]
    return run({"prompt": chat, **media}, {**PARAMS, **SPOKEN, **params})


def assert_spoken(out, ref):
    assert out["text"] == ref.text
    assert out["codes"].reshape(-1).tolist() == ref.codec_ids.tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_talker_codes_match_generate(spoken_plan, spoken, name):
    """The talker on a media prompt: `generate`'s codes, its conditioning zero at the media
    positions' embeddings (the thinker's hidden state alone there) and its positions 1-D
    (generate's talker gets no attention mask, so it never computes 3-D ones)."""
    assert_spoken(_spoken(Interpreter(spoken_plan).run, name), spoken[name])


def test_the_media_change_the_codes(spoken):
    """Guards against codes that ignore their conditioning: every case speaks differently."""
    codes = [tuple(ref.codec_ids.tolist()) for ref in spoken.values()]
    assert len(set(codes)) == len(codes)
    assert all(len(c) > 1 for c in codes)


def noisy_clip(path, seconds: float):
    """The checkpoint's feature extractor, and a tone of `seconds` with noise."""
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(path)
    clip = media.audio(seconds, 330.0) + 0.01 * torch.randn(int(seconds * towers.SAMPLE_RATE))
    return extractor, clip


@pytest.mark.parametrize("seconds", [0.03, 5.0, 31.0])
def test_audio_features_are_the_processors(path, seconds):
    """The tower's features of a clip padded by one FFT window are the frames the processor's
    30 s window keeps (a longer clip cut at 30 s)."""
    extractor, clip = noisy_clip(path, seconds)
    out = extractor(clip.numpy(), sampling_rate=16000, padding="max_length",
                    return_attention_mask=True, return_tensors="pt")  # fmt: skip
    kept = out["attention_mask"][0].bool()
    features, length = towers.audio_features(extractor, clip, **towers.AudioTower.feature_options)
    assert length == int(kept.sum()) == min(round(seconds * 100), 3000)
    torch.testing.assert_close(features, out["input_features"][0][:, kept], atol=1e-6, rtol=0)


@pytest.mark.parametrize("height, width", [(3, 60), (1, 150), (60, 3)])
def test_an_image_one_or_three_pixels_high_is_read_as_it_is(path, height, width):
    """(Left to guess, the image processor took a `[3, W, 3]` array for channels first: the
    picture's grid and pixels came out transposed.) The tower's patches of an image tensor
    are the processor's of the same picture as PIL reads it."""
    from PIL import Image

    tower = towers.load(str(path), "visual", torch.float32)
    image = media.image(7, height, width)
    prepared = tower.prepare("image", image)
    want = tower.images(images=[Image.fromarray(image.numpy())], return_tensors="pt")
    assert list(prepared.meta[1:]) == want["image_grid_thw"][0].tolist()
    torch.testing.assert_close(prepared.features, want["pixel_values"])


@pytest.mark.gpu
@pytest.mark.parametrize("seconds", [0.03, 5.0, 31.0])
def test_audio_features_on_the_gpu_are_the_cpus(path, seconds):
    """A tower on a GPU computes the features there: the CPU's frames, within float32 noise.
    (Its set-up, `noisy_clip` and the CPU's features, is the test above's.)"""
    extractor, clip = noisy_clip(path, seconds)
    options = towers.AudioTower.feature_options
    on_cpu, length = towers.audio_features(extractor, clip, **options)
    on_gpu, gpu_length = towers.audio_features(extractor, clip, device="cuda", **options)
    assert gpu_length == length
    torch.testing.assert_close(on_gpu, on_cpu, atol=1e-4, rtol=0)


# One chunk, a part of one, several, one frame; one clip at a time and several at once (the
# first batch's 4 chunks leave a row in the buffers of the second's 3); the last batch has
# more chunks (45) than the tower's graphs take.
AUDIO_BATCHES = [
    [600, 200], [500], [3], [200], [201, 77, 3000, 1], [399, 400, 401], [3000, 3000, 3000]
]  # fmt: skip


def _audio_tower_cases(model, batches, dtype, device, graphs=None):
    """(ours, transformers') embeddings of random features for each batch of clip lengths."""
    for lengths in batches:
        features = torch.randn(model.config.num_mel_bins, sum(lengths), dtype=dtype)
        feature_lens = torch.tensor(lengths, device=device)
        after, _ = model._get_feat_extract_output_lengths(feature_lens)
        with torch.inference_mode():
            theirs = model(features.to(device), feature_lens=feature_lens, aftercnn_lens=after)
            ours = towers.encode_clips(model, features, lengths, graphs)
            yield ours, theirs.last_hidden_state


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static-buffers"])
def test_the_audio_tower_in_one_pass_is_transformers_forward(path, static):
    """Clips of every shape the chunking has: our batched pass gives transformers'
    embeddings, eagerly and through the graphs' static buffers (run eagerly on the CPU: the
    chunk-count buckets, the full-window padding, the rows of an earlier step left in a
    bucket's buffers)."""
    tower = towers.load(str(path), "audio_tower", torch.float32)
    graphs = towers.clip_graphs(tower.model, capture=False) if static else None
    cases = _audio_tower_cases(tower.model, AUDIO_BATCHES, torch.float32, "cpu", graphs)
    for ours, theirs in cases:
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def real_size_audio_tower(device: str):
    """Qwen2.5-Omni-7B's audio tower (random bf16 weights, none on the meta device) and its
    chunk-count graphs (captured on CUDA)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    from omniflow.checkpoints.scaled import initialising_bf16_on
    from omniflow.families.qwen2_5_omni.checkpoints import scaled_omni_config

    config = scaled_omni_config(1.0)[0].thinker_config.audio_config
    with initialising_bf16_on(device):
        model = Qwen2_5OmniAudioEncoder(config).eval()
    return model, towers.clip_graphs(model, capture=device.startswith("cuda"))


def test_the_real_size_audio_tower_has_graphs_for_all_but_the_largest_batch():
    """The GPU test's tower and graphs, built on the meta device: every batch of
    AUDIO_BATCHES but the last fits a graph's chunk count, so all but it replay."""
    model, graphs = real_size_audio_tower("meta")
    assert sorted(graphs.keys()) == [1, 2, 4, 8, 16, 24, 32]
    window = model.n_window * 2
    chunks = [sum(-(-n // window) for n in lengths) for lengths in AUDIO_BATCHES]
    assert [c > max(graphs.keys()) for c in chunks] == [False] * (len(AUDIO_BATCHES) - 1) + [True]


@pytest.mark.gpu
def test_the_audio_tower_in_one_pass_at_real_size_on_the_gpu():
    """The same at Qwen2.5-Omni-7B's audio tower size in bf16 on CUDA (random weights),
    eagerly and replaying the tower's CUDA graphs."""
    model, graphs = real_size_audio_tower("cuda")
    assert graphs.captures == len(graphs.keys())
    for replay in (None, graphs):
        for ours, theirs in _audio_tower_cases(
            model, AUDIO_BATCHES, torch.bfloat16, "cuda", replay
        ):
            scale = theirs.float().abs().max()
            assert (ours.float() - theirs.float()).abs().max() <= 0.03 * scale
    assert graphs.replays == len(AUDIO_BATCHES) - 1  # the 45-chunk batch runs eagerly


def test_the_media_change_the_answer(references):
    """Guards against a reference that ignores its media: every case answers differently."""
    answers = [tuple(ids) for ids in references.values()]
    assert len(set(answers)) == len(answers)


def test_engine_batches_every_case_at_once(spoken_plan, path, references, spoken):
    """All cases at once in one engine: the towers encode items of several requests in one
    forward, the thinker decodes them in one batch, the talker too; the same text as alone
    and `generate`'s codes."""
    from concurrent.futures import ThreadPoolExecutor

    with Engine(spoken_plan, "inprocess") as engine, ThreadPoolExecutor(len(CASES)) as pool:
        outs = dict(
            zip(CASES, pool.map(lambda name: _spoken(engine.generate, name), CASES), strict=True)
        )
    for name, out in outs.items():
        assert out["text"] == _text(path, references[name]), name
        assert_spoken(out, spoken[name])


def test_a_text_only_request_is_unchanged(plan, path):
    """No media: the towers do nothing (their inputs end empty) and the thinker's answer is
    its text-only one, `reference_omni_generate`'s."""
    from omniflow.families.qwen2_5_omni.checkpoints import reference_omni_generate

    out = Interpreter(plan).run({"prompt": "Tell me a short story."}, PARAMS)
    ref = reference_omni_generate(
        path, "Tell me a short story.", max_new_tokens=MAX_TOKENS, talker_max_new_tokens=4
    )
    assert out["text"] == ref.text


def test_media_the_chat_has_no_place_for_fail_the_request(plan):
    with pytest.raises(Exception, match="no place for|more image parts"):
        Interpreter(plan).run({"prompt": "Hello", "image": media.image(0, 56, 56)}, PARAMS)


def test_bad_media_are_refused_at_admission(plan):
    with pytest.raises(RequestError, match="video"):
        Interpreter(plan).run({"prompt": "Hi", "video": "/no/such/video.mp4"}, PARAMS)

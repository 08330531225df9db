"""Where component configs come from: the builtin catalog, local directories (transformers
and diffusers layouts), the Hugging Face cache, and the errors when nothing matches."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from omniflow.catalog import (
    ComponentConfig,
    builtin_files,
    count_checkpoint_parameters,
    count_parameters,
    estimate_cost,
    known_models,
    load_component_config,
)
from omniflow.errors import ModelConfigError

transformers.logging.set_verbosity_error()

GRAPHS = Path(__file__).resolve().parents[2] / "graphs"
TINY_QWEN2 = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    vocab_size=64,
)


@pytest.fixture(autouse=True)
def hub(tmp_path_factory, monkeypatch) -> Path:
    """An empty hub cache of the test's own, so nothing on this machine shadows the catalog."""
    cache = tmp_path_factory.mktemp("hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


BUILTIN = [
    ("Qwen/Qwen2.5-Omni-7B", "thinker", "decoder_lm"),
    ("Qwen/Qwen2.5-Omni-7B", "talker", "decoder_lm"),
    ("Qwen/Qwen2.5-Omni-7B", "token2wav", "vocoder"),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "thinker", "moe_lm"),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "audio_tower", "audio_encoder"),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "visual", "vision_encoder"),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "talker", "moe_lm"),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "code2wav", "vocoder"),
    ("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "talker", "decoder_lm"),
    ("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "code2wav", "vocoder"),
    ("Qwen/Qwen3-TTS-12Hz-1.7B-Base", "talker", "decoder_lm"),
    ("Qwen/Qwen3-TTS-12Hz-1.7B-Base", "code2wav", "vocoder"),
    ("Qwen/Qwen-Image", "text_encoder", "text_encoder"),
    ("Qwen/Qwen-Image", "transformer", "dit"),
    ("Qwen/Qwen-Image", "vae", "vae"),
    ("Qwen/Qwen-Image-Edit", "text_encoder", "text_encoder"),
    ("Qwen/Qwen-Image-Edit", "transformer", "dit"),
    ("Qwen/Qwen-Image-Edit", "vae", "vae"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "visual", "vision_encoder"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "language_model", "decoder_lm"),
    ("Qwen/Qwen2.5-0.5B-Instruct", None, "decoder_lm"),
    ("Qwen/Qwen2.5-7B-Instruct", None, "decoder_lm"),
]


@pytest.mark.parametrize("model,component,family", BUILTIN)
def test_builtin_components(model, component, family):
    cfg = load_component_config(model, component)
    assert (cfg.model, cfg.component, cfg.category) == (model, component, family)
    assert cfg.source == "builtin catalog"
    assert model in known_models()
    assert estimate_cost(cfg, max_batch=2, max_len=64).total_bytes > 0


def test_lookup_ignores_case_and_surrounding_noise():
    cfg = load_component_config("  qwen/QWEN2.5-omni-7b/ ", "talker")
    assert cfg.model == "Qwen/Qwen2.5-Omni-7B"


def test_shape_facts_of_the_omni_models():
    thinker = load_component_config("Qwen/Qwen2.5-Omni-7B", "thinker")
    assert (thinker.hidden_size, thinker.vocab_size) == (3584, 152064)
    # Its towers are parts of their own, counted there (encoder stages run them).
    assert "extra_parameters" not in thinker.config
    audio = load_component_config("Qwen/Qwen2.5-Omni-7B", "audio_tower")
    visual = load_component_config("Qwen/Qwen2.5-Omni-7B", "visual")
    assert (audio.category, audio.config["num_parameters"]) == ("audio_encoder", 639_647_232)
    assert (visual.category, visual.config["num_parameters"]) == ("vision_encoder", 676_550_144)
    talker = load_component_config("Qwen/Qwen2.5-Omni-7B", "talker")
    assert (talker.hidden_size, talker.vocab_size, talker.num_codebooks) == (896, 8448, 1)
    token2wav = load_component_config("Qwen/Qwen2.5-Omni-7B", "token2wav")
    assert (token2wav.sample_rate, token2wav.samples_per_frame, token2wav.frame_rate) == (
        24000,
        480,
        50.0,
    )
    assert token2wav.dtype == "float32"  # transformers runs token2wav in float32

    thinker3 = load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "thinker")
    assert "extra_parameters" not in thinker3.config  # its towers are parts of their own
    audio3 = load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "audio_tower")
    visual3 = load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "visual")
    assert (audio3.hidden_size, audio3.config["num_parameters"]) == (2048, 647_927_168)
    # The vision tower's hidden output: its embeddings and 3 deepstack layers' features.
    assert (visual3.hidden_size, visual3.config["num_parameters"]) == (4 * 2048, 538_631_408)
    talker3 = load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "talker")
    assert (talker3.num_code_groups, talker3.vocab_size) == (16, 3072)
    assert talker3.config["num_experts"] == 128
    code2wav = load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "code2wav")
    assert (code2wav.samples_per_frame, code2wav.frame_rate, code2wav.num_codebooks) == (
        1920,
        12.5,
        16,
    )


def test_shape_facts_of_the_tts_model():
    talker = load_component_config("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "talker")
    assert (talker.hidden_size, talker.vocab_size, talker.num_codebooks) == (2048, 3072, 16)
    # A Base checkpoint's speaker encoder runs in the voice_encoder stage, which counts it
    # (tests/families/test_qwen3_tts.py), not in the talker.
    base = load_component_config("Qwen/Qwen3-TTS-12Hz-1.7B-Base", "talker")
    assert "speaker_encoder" not in talker.config["extra_parameters"]
    assert "speaker_encoder" not in base.config["extra_parameters"]
    decoder = load_component_config("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "code2wav")
    # The 12 Hz tokenizer runs at 12.5 frames/s: 1920 samples of 24 kHz audio per frame.
    assert (decoder.sample_rate, decoder.samples_per_frame, decoder.num_codebooks) == (
        24000,
        1920,
        16,
    )


def test_tiny_tts_parts_are_a_codec_lm_and_its_codec():
    """tiny:tts is a model index of transformers parts, not a diffusers pipeline: its talker
    is a decoder LM, its DAC the vocoder, and the index supplies the audio facts."""
    talker = load_component_config("tiny:tts", "talker")
    assert talker.category == "decoder_lm"
    assert (talker.hidden_size, talker.vocab_size, talker.num_codebooks) == (64, 896, 1)
    code2wav = load_component_config("tiny:tts", "code2wav")
    assert code2wav.category == "vocoder"
    assert (code2wav.sample_rate, code2wav.samples_per_frame, code2wav.num_codebooks) == (
        24000,
        1920,
        1,
    )
    assert code2wav.frame_rate == 12.5
    assert (code2wav.dtype, code2wav.config["num_parameters"]) == ("float32", 212_305)
    assert estimate_cost(code2wav, max_batch=2, max_len=64).total_bytes > 0


def test_shape_facts_of_the_image_models():
    dit = load_component_config("Qwen/Qwen-Image", "transformer")
    assert (dit.latent_channels, dit.vae_scale_factor, dit.patch_size) == (16, 8, 2)
    assert dit.image_tokens(1024, 1024) == 64 * 64
    assert dit.hidden_size == 3072
    vae = load_component_config("Qwen/Qwen-Image", "vae")
    assert (vae.latent_channels, vae.vae_scale_factor) == (16, 8)
    encoder = load_component_config("Qwen/Qwen-Image", "text_encoder")
    assert encoder.hidden_size == 3584
    assert encoder.config["extra_parameters"] == {"visual": 676_550_144}
    visual = load_component_config("Qwen/Qwen2.5-VL-7B-Instruct", "visual")
    assert (visual.hidden_size, visual.patch_size) == (3584, 14)


def test_the_edit_pipeline_conditions_on_as_many_image_tokens_as_its_input_image_makes():
    """The input image as QwenImageEditPipeline resizes it (calculate_dimensions: about
    CONDITION_AREA pixels, sides multiples of 32) makes at most the catalog's tokens for
    every aspect ratio its Qwen2VLProcessor accepts, and exactly as many for some, for the
    real checkpoint and the tiny one alike."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from omniflow.backends.diffusion import MAX_ASPECT
    from omniflow.families.qwen_image.pipeline import CONDITION_AREA

    processor = builtin_files("Qwen/Qwen-Image-Edit")["processor/preprocessor_config.json"]
    factor = processor["patch_size"] * processor["merge_size"]
    dit = load_component_config("Qwen/Qwen-Image-Edit", "transformer")
    side = dit.vae_scale_factor * dit.patch_size
    # The result only changes where sqrt(area * ratio) or sqrt(area / ratio) crosses a half
    # multiple of 32: one ratio between each two such points covers every result.
    edges = sorted(
        {32 * (k + 0.5) for k in range(1000)}
        | {CONDITION_AREA / (32 * (k + 0.5)) for k in range(1000)}
    )
    tokens = patches = 0
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        ratio = ((low + high) / 2) ** 2 / CONDITION_AREA
        width, height, _ = calculate_dimensions(CONDITION_AREA, ratio)
        if min(width, height) < 32 or max(width, height) > MAX_ASPECT * min(width, height):
            continue
        h, w = smart_resize(height, width, factor, processor["min_pixels"], processor["max_pixels"])
        tokens = max(tokens, (h // factor) * (w // factor))
        patches = max(patches, (height // side) * (width // side))
    for model in ("Qwen/Qwen-Image-Edit", "tiny:image-edit"):
        encoder = load_component_config(model, "text_encoder")
        assert encoder.config["condition_image_tokens"] == tokens == 1675
        transformer = load_component_config(model, "transformer")
        assert transformer.config["condition_image_tokens"] == patches == 4920
    # Qwen-Image conditions on no image.
    assert (
        "condition_image_tokens"
        not in load_component_config("Qwen/Qwen-Image", "transformer").config
    )


def test_every_example_graph_resolves():
    """Each (model, component) the example pipelines name is in the catalog."""
    pairs = set()
    for path in GRAPHS.glob("*.omni"):
        text = path.read_text()
        model = re.search(r'^\s*model\s+"([^"]+)"', text, re.M).group(1)
        pairs |= {(model, c) for c in re.findall(r'component="([^"]+)"', text)}
    assert len(pairs) >= 10
    for model, component in pairs:
        assert load_component_config(model, component).component == component


def test_local_directory_with_a_saved_model(tmp_path):
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY_QWEN2))
    model.save_pretrained(tmp_path)
    cfg = load_component_config(str(tmp_path))
    assert cfg.category == "decoder_lm"
    assert cfg.source == f"local: {tmp_path}"
    assert cfg.dtype == "float32"  # as saved
    assert cfg.hidden_size == 32
    assert count_parameters(cfg) == sum(p.numel() for p in model.parameters())
    with pytest.raises(ModelConfigError, match="single-part model"):
        load_component_config(str(tmp_path), "talker")


def test_local_lm_outside_the_formula_is_counted_from_its_checkpoint(tmp_path):
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    )
    model.save_pretrained(tmp_path)
    cfg = load_component_config(str(tmp_path))
    cost = estimate_cost(cfg, max_batch=1, max_len=8)
    assert cost.params_source == "count"
    assert cost.params == sum(p.numel() for p in model.parameters())


def test_local_multi_part_config(tmp_path):
    """A hand-written omni config: components picked by name, tying read from the thinker."""
    write_json(
        tmp_path / "config.json",
        {
            "model_type": "qwen2_5_omni",
            "thinker_config": {
                "tie_word_embeddings": False,
                "text_config": {**TINY_QWEN2, "tie_word_embeddings": True},
            },
            "talker_config": {**TINY_QWEN2, "hidden_size": 16, "embedding_size": 32},
        },
    )
    thinker = load_component_config(str(tmp_path), "thinker")
    assert thinker.config["tie_word_embeddings"] is False
    assert thinker.hidden_size == 32 and "extra_parameters" not in thinker.config
    talker = load_component_config(str(tmp_path), "talker")
    assert (talker.hidden_size, talker.num_codebooks) == (16, 1)
    with pytest.raises(ModelConfigError, match="no 'token2wav_config' section"):
        load_component_config(str(tmp_path), "token2wav")


def test_local_multi_part_counts_its_extras_from_the_checkpoint(tmp_path):
    files = builtin_files("Qwen/Qwen2.5-Omni-7B")
    write_json(tmp_path / "config.json", files["config.json"])
    save_file(
        {
            "thinker.model.embed_tokens.weight": torch.zeros(4, 4),
            "thinker.audio_tower.conv1.weight": torch.zeros(3, 4),
            "thinker.visual.patch_embed.weight": torch.zeros(5),
            "talker.thinker_to_talker_proj.weight": torch.zeros(2, 3),
            "token2wav.code2wav_dit_model.w": torch.zeros(7, 7),
        },
        tmp_path / "model.safetensors",
    )
    thinker = load_component_config(str(tmp_path), "thinker")
    assert "extra_parameters" not in thinker.config
    assert load_component_config(str(tmp_path), "audio_tower").config["num_parameters"] == 12
    assert load_component_config(str(tmp_path), "visual").config["num_parameters"] == 5
    assert thinker.hidden_size == 3584
    assert load_component_config(str(tmp_path), "token2wav").config["num_parameters"] == 49
    talker = load_component_config(str(tmp_path), "talker")
    assert talker.config["extra_parameters"] == {"thinker_to_talker_proj": 6}


def test_local_diffusers_layout(tmp_path):
    import diffusers

    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1)
    vae.save_pretrained(tmp_path / "vae")
    dit = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    )
    dit.save_config(tmp_path / "transformer")
    write_json(
        tmp_path / "model_index.json",
        {
            "_class_name": "QwenImagePipeline",
            "transformer": ["diffusers", "QwenImageTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKLQwenImage"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        },
    )
    transformer = load_component_config(str(tmp_path), "transformer")
    assert transformer.category == "dit"
    assert transformer.vae_scale_factor == 2 ** len(vae.config.temperal_downsample)
    assert count_parameters(transformer) == sum(p.numel() for p in dit.parameters())
    decoder = load_component_config(str(tmp_path), "vae")
    # No formula for this VAE: its checkpoint's headers give the exact count.
    assert decoder.config["num_parameters"] == sum(p.numel() for p in vae.parameters())
    assert estimate_cost(decoder, max_batch=1, max_len=16).params_source == "count"
    with pytest.raises(ModelConfigError, match="components are: transformer, vae"):
        load_component_config(str(tmp_path), "scheduler")


def test_hf_cache_layout(hub):
    snapshot = hub / "models--Acme--Tiny-LM" / "snapshots" / "abc"
    write_json(snapshot / "config.json", {"model_type": "qwen2", **TINY_QWEN2})
    cfg = load_component_config("acme/tiny-lm")
    assert cfg.model == "Acme/Tiny-LM"
    assert cfg.source == f"hf-cache: {snapshot}"
    assert cfg.hidden_size == 32


def test_hf_cache_follows_refs_main(hub):
    repo = hub / "models--Acme--Tiny-LM"
    for rev, hidden in (("old", 16), ("new", 32)):
        write_json(repo / "snapshots" / rev / "config.json", {**TINY_QWEN2, "hidden_size": hidden})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("old")
    assert load_component_config("Acme/Tiny-LM").hidden_size == 16


def test_hf_cache_beats_the_builtin_catalog_and_borrows_its_counts(hub, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(hub.parent))
    hub = hub.parent / "hub"
    snapshot = hub / "models--Qwen--Qwen2.5-Omni-7B" / "snapshots" / "abc"
    write_json(snapshot / "config.json", builtin_files("Qwen/Qwen2.5-Omni-7B")["config.json"])
    token2wav = load_component_config("Qwen/Qwen2.5-Omni-7B", "token2wav")
    assert token2wav.source.startswith("hf-cache: ")
    # No weights downloaded: the count comes from the builtin catalog.
    assert token2wav.config["num_parameters"] == 449_051_264


def test_checkpoint_index_limits_the_files_counted(tmp_path):
    save_file({"a": torch.zeros(2, 3)}, tmp_path / "model-00001-of-00001.safetensors")
    save_file({"a": torch.zeros(2, 3)}, tmp_path / "consolidated.safetensors")
    assert count_checkpoint_parameters(tmp_path) == 12
    write_json(
        tmp_path / "model.safetensors.index.json",
        {"weight_map": {"a": "model-00001-of-00001.safetensors"}},
    )
    assert count_checkpoint_parameters(tmp_path) == 6
    assert count_checkpoint_parameters(tmp_path / "missing") is None


def test_unknown_model_lists_known_models_and_suggests():
    with pytest.raises(ModelConfigError) as err:
        load_component_config("Qwen/Qwen2.5-7B-Instrct")
    message = str(err.value)
    assert "unknown model 'Qwen/Qwen2.5-7B-Instrct'" in message
    assert all(name in message for name in known_models())
    assert "did you mean 'Qwen/Qwen2.5-7B-Instruct'?" in message
    with pytest.raises(ModelConfigError) as err:
        load_component_config("acme/nothing-like-it")
    assert "did you mean" not in str(err.value)


def test_unknown_component_lists_components_and_suggests():
    with pytest.raises(ModelConfigError) as err:
        load_component_config("Qwen/Qwen2.5-Omni-7B", "talkr")
    message = str(err.value)
    assert "its components are: audio_tower, talker, thinker, token2wav, visual" in message
    assert "did you mean 'talker'?" in message


def test_component_is_required_exactly_when_the_model_has_parts():
    with pytest.raises(ModelConfigError, match="name one of: text_encoder, transformer, vae"):
        load_component_config("Qwen/Qwen-Image")
    with pytest.raises(ModelConfigError, match="single-part model"):
        load_component_config("Qwen/Qwen2.5-7B-Instruct", "language_model")


def test_builtin_files_are_a_copy():
    files = builtin_files("qwen/qwen-image")
    files["vae/config.json"]["z_dim"] = 99
    assert load_component_config("Qwen/Qwen-Image", "vae").latent_channels == 16
    with pytest.raises(ModelConfigError, match="did you mean 'Qwen/Qwen-Image'"):
        builtin_files("Qwen/Qwen-Imag")


def test_component_config_is_hashable_and_frozen():
    cfg = load_component_config("Qwen/Qwen2.5-0.5B-Instruct")
    assert isinstance(cfg, ComponentConfig)
    hash(cfg)
    with pytest.raises(AttributeError):
        cfg.category = "vae"

"""Cost estimates against the real thing.

Parameter formulas are compared with `sum(p.numel())` of the transformers / diffusers
classes: tiny configs instantiated for real, published dims under torch.device("meta").
KV bytes are compared with a real DynamicCache, FLOPs with torch's FlopCounterMode.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from omniflow.catalog import (
    ComponentConfig,
    builtin_files,
    count_checkpoint_parameters,
    count_parameters,
    estimate_cost,
    load_component_config,
)
from omniflow.catalog.costs import PREFILL_TOKENS, VOCODER_FORWARD_FRAMES
from omniflow.errors import ModelConfigError

transformers.logging.set_verbosity_error()

TINY = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
)
MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path_factory, monkeypatch):
    """Builtin lookups must not be shadowed by whatever this machine has cached."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path_factory.mktemp("empty-hub")))


def numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def via_catalog(tmp_path, hf_config) -> ComponentConfig:
    """The component as the compiler sees it: the config saved to a directory and loaded."""
    hf_config.save_pretrained(tmp_path)
    return load_component_config(str(tmp_path))


TINY_LMS = {
    "qwen2": lambda: transformers.Qwen2Config(**TINY),
    "qwen2-tied": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "llama-biased": lambda: transformers.LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
    "llama-head-dim": lambda: transformers.LlamaConfig(**TINY, head_dim=24),
    "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=24),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(
        **TINY, **MOE, head_dim=16, mlp_only_layers=[1]
    ),
    "qwen3-moe-step": lambda: transformers.Qwen3MoeConfig(**TINY, **MOE, decoder_sparse_step=2),
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(
        **TINY, **MOE, shared_expert_intermediate_size=48
    ),
    "qwen2-moe-no-qkv-bias": lambda: transformers.Qwen2MoeConfig(
        **TINY, **MOE, shared_expert_intermediate_size=48, qkv_bias=False
    ),
}


@pytest.mark.parametrize("name", TINY_LMS)
def test_lm_params_exact_on_tiny_models(name, tmp_path):
    hf_config = TINY_LMS[name]()
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    cfg = via_catalog(tmp_path, hf_config)
    assert cfg.category == ("moe_lm" if "moe" in name else "decoder_lm")
    assert count_parameters(cfg) == numel(model)


def test_qwen2_5_7b_params_exact_at_published_dims():
    cfg = load_component_config("Qwen/Qwen2.5-7B-Instruct")
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**cfg.config))
    assert count_parameters(cfg) == numel(model) == 7_615_616_512


def _root(model: str, path: str = "config.json") -> dict:
    return builtin_files(model)[path]


def _omni(family: str, model: str, cls_name: str, config_name: str, section: str):
    """A transformers omni sub-model built from the builtin catalog's `section`."""
    conf = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    config = getattr(conf, config_name)(**_root(model)[section])
    return getattr(modeling, cls_name)(config)


def _qwen25_omni(cls_name: str, config_name: str, section: str):
    return _omni("qwen2_5_omni", "Qwen/Qwen2.5-Omni-7B", cls_name, config_name, section)


def _without_towers(thinker):
    del thinker.model.audio_tower, thinker.model.visual
    return thinker


def _qwen3_omni(cls_name: str, config_name: str, section: str):
    return _omni(
        "qwen3_omni_moe", "Qwen/Qwen3-Omni-30B-A3B-Instruct", cls_name, config_name, section
    )


def _qwen3_omni_thinker():
    return _qwen3_omni(
        "Qwen3OmniMoeThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerConfig", "thinker_config"
    )


def _qwen25_vl(part: str, model: str = "Qwen/Qwen2.5-VL-7B-Instruct", path: str = "config.json"):
    vl = transformers.Qwen2_5_VLForConditionalGeneration(
        transformers.Qwen2_5_VLConfig(**_root(model, path))
    )
    return {
        "whole": [vl],
        "language_model": [vl.model.language_model, vl.lm_head],
        "visual": [vl.model.visual],
    }[part]


def _diffusers(cls_name: str, component: str, model: str = "Qwen/Qwen-Image"):
    import diffusers

    config = dict(_root(model, f"{component}/config.json"))
    config.pop("_class_name")
    return getattr(diffusers, cls_name)(**config)


# Every builtin component whose architecture an installed library can build.
PUBLISHED = {
    ("Qwen/Qwen2.5-0.5B-Instruct", None): lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**_root("Qwen/Qwen2.5-0.5B-Instruct"))
    ),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "language_model"): lambda: _qwen25_vl("language_model"),
    ("Qwen/Qwen2.5-VL-7B-Instruct", "visual"): lambda: _qwen25_vl("visual"),
    # The thinker less its towers, which are parts of their own (encoder stages run them).
    ("Qwen/Qwen2.5-Omni-7B", "thinker"): lambda: _without_towers(
        _qwen25_omni(
            "Qwen2_5OmniThinkerForConditionalGeneration",
            "Qwen2_5OmniThinkerConfig",
            "thinker_config",
        )
    ),
    ("Qwen/Qwen2.5-Omni-7B", "talker"): lambda: _qwen25_omni(
        "Qwen2_5OmniTalkerForConditionalGeneration", "Qwen2_5OmniTalkerConfig", "talker_config"
    ),
    ("Qwen/Qwen2.5-Omni-7B", "token2wav"): lambda: _qwen25_omni(
        "Qwen2_5OmniToken2WavModel", "Qwen2_5OmniToken2WavConfig", "token2wav_config"
    ),
    # The thinker less its towers, which are parts of their own (encoder stages run them).
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "thinker"): lambda: _without_towers(_qwen3_omni_thinker()),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "audio_tower"): lambda: (
        _qwen3_omni_thinker().model.audio_tower
    ),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "visual"): lambda: _qwen3_omni_thinker().model.visual,
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "talker"): lambda: _qwen3_omni(
        "Qwen3OmniMoeTalkerForConditionalGeneration", "Qwen3OmniMoeTalkerConfig", "talker_config"
    ),
    ("Qwen/Qwen3-Omni-30B-A3B-Instruct", "code2wav"): lambda: _qwen3_omni(
        "Qwen3OmniMoeCode2Wav", "Qwen3OmniMoeCode2WavConfig", "code2wav_config"
    ),
    ("Qwen/Qwen-Image", "text_encoder"): lambda: _qwen25_vl(
        "whole", "Qwen/Qwen-Image", "text_encoder/config.json"
    ),
    ("Qwen/Qwen-Image", "transformer"): lambda: _diffusers(
        "QwenImageTransformer2DModel", "transformer"
    ),
    ("Qwen/Qwen-Image", "vae"): lambda: _diffusers("AutoencoderKLQwenImage", "vae"),
    ("Qwen/Qwen-Image-Edit", "text_encoder"): lambda: _qwen25_vl(
        "whole", "Qwen/Qwen-Image-Edit", "text_encoder/config.json"
    ),
    ("Qwen/Qwen-Image-Edit", "transformer"): lambda: _diffusers(
        "QwenImageTransformer2DModel", "transformer", "Qwen/Qwen-Image-Edit"
    ),
    ("Qwen/Qwen-Image-Edit", "vae"): lambda: _diffusers(
        "AutoencoderKLQwenImage", "vae", "Qwen/Qwen-Image-Edit"
    ),
}


@pytest.mark.parametrize("model,component", PUBLISHED)
def test_builtin_params_exact_at_published_dims(model, component):
    """Formulas and the catalog's counts both, against the class built at the published dims."""
    with torch.device("meta"):
        modules = PUBLISHED[(model, component)]()
    modules = modules if isinstance(modules, list) else [modules]
    assert count_parameters(load_component_config(model, component)) == sum(map(numel, modules))


def test_qwen3_omni_thinker_counts_only_active_experts():
    cost = estimate_cost(
        load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "thinker"),
        max_batch=1,
        max_len=1,
    )
    # 30B-A3B: about 3B parameters touched per token out of ~30.5B loaded (its towers are
    # parts of their own, encoder stages).
    assert cost.params == 30_532_646_912
    assert 2.9e9 < cost.active_params < 3.2e9
    assert cost.flops_per_item == pytest.approx(2 * cost.active_params, rel=1e-3)


def test_qwen_image_transformer_formula_exact_on_tiny_configs():
    import diffusers

    for extra in ({}, {"use_additional_t_cond": True}):
        model = diffusers.QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=24,
            axes_dims_rope=(4, 6, 6),
            **extra,
        )
        config = {"_class_name": "QwenImageTransformer2DModel", **model.config}
        cfg = ComponentConfig("tiny", "transformer", "dit", config)
        assert count_parameters(cfg) == numel(model)


AUTOENCODERS = {
    "two-blocks": dict(block_out_channels=(8, 16), layers_per_block=1),
    "three-blocks-no-attention": dict(
        block_out_channels=(8, 16, 16),
        layers_per_block=2,
        mid_block_add_attention=False,
        use_quant_conv=False,
    ),
}


def _autoencoder_kl(**kw):
    import diffusers

    blocks = len(kw["block_out_channels"])
    return diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        latent_channels=4,
        norm_num_groups=4,
        **kw,
    )


@pytest.mark.parametrize("name", AUTOENCODERS)
def test_autoencoder_kl_formula_exact_on_tiny_configs(name):
    vae = _autoencoder_kl(**AUTOENCODERS[name])
    cfg = ComponentConfig("tiny", "vae", "vae", {"_class_name": "AutoencoderKL", **vae.config})
    assert count_parameters(cfg) == numel(vae)
    assert cfg.vae_scale_factor == 2 ** (len(AUTOENCODERS[name]["block_out_channels"]) - 1)


def test_kv_bytes_match_a_real_dynamic_cache():
    hf_config = transformers.Qwen2Config(**TINY)
    model = transformers.Qwen2ForCausalLM(hf_config).to(torch.bfloat16).eval()
    batch, tokens = 3, 11
    with torch.no_grad():
        out = model(torch.randint(0, TINY["vocab_size"], (batch, tokens)), use_cache=True)
    cached = sum(
        t.numel() * t.element_size()
        for layer in out.past_key_values.layers
        for t in (layer.keys, layer.values)
    )
    cfg = ComponentConfig("tiny", None, "decoder_lm", hf_config.to_dict())
    cost = estimate_cost(cfg, max_batch=batch, max_len=tokens, dtype="bfloat16")
    assert cost.kv_cache_bytes == cached == batch * tokens * cost.kv_bytes_per_token


def _measured_flops(run) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        run()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["qwen2", "llama-biased", "qwen3-moe", "qwen2-moe"])
def test_lm_flops_per_token_match_the_flop_counter(name, tmp_path):
    """A prefill of N tokens: every token's linears plus attention over N keys, exactly.

    Eager attention and eager experts, so the counter sees every matmul (with SDPA on CPU
    it sees no attention; fused experts hide the expert matmuls).
    """
    hf_config = TINY_LMS[name]()
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    batch, tokens = 2, 9
    ids = torch.randint(0, TINY["vocab_size"], (batch, tokens))
    measured = _measured_flops(lambda: model(ids))
    cost = estimate_cost(via_catalog(tmp_path, hf_config), max_batch=batch, max_len=tokens)
    assert cost.flops_per_item * batch * tokens == measured


def test_moe_flops_grow_with_routed_experts_only(tmp_path):
    def cost(top_k):
        hf_config = transformers.Qwen3MoeConfig(**{**TINY, **MOE, "num_experts_per_tok": top_k})
        return estimate_cost(via_catalog(tmp_path / str(top_k), hf_config), max_batch=1, max_len=8)

    one, two = cost(1), cost(2)
    expert = 3 * TINY["hidden_size"] * MOE["moe_intermediate_size"]
    assert one.params == two.params
    assert two.active_params - one.active_params == TINY["num_hidden_layers"] * expert
    assert two.flops_per_item - one.flops_per_item == 2 * TINY["num_hidden_layers"] * expert


def test_qwen_image_dit_flops_match_the_flop_counter():
    """Linear FLOPs exactly; the counter sees no CPU SDPA, so attention is added here."""
    import diffusers

    heads, head_dim, layers, joint = 2, 16, 2, 24
    model = diffusers.QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=joint,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    batch, grid, text = 2, 4, 5
    image = grid * grid
    inputs = dict(
        hidden_states=torch.randn(batch, image, 16),
        encoder_hidden_states=torch.randn(batch, text, joint),
        encoder_hidden_states_mask=torch.ones(batch, text),
        timestep=torch.tensor([0.5] * batch),
        img_shapes=[(1, grid, grid)] * batch,
    )
    measured = _measured_flops(lambda: model(**inputs))
    config = {"_class_name": "QwenImageTransformer2DModel", **model.config}
    cfg = ComponentConfig("tiny", "transformer", "dit", config)
    cost = estimate_cost(cfg, max_batch=batch, max_len=image, context_len=text)
    attention = 4 * layers * heads * head_dim * (image + text) ** 2
    assert cost.flops_per_item * batch == measured + attention * batch


def test_code2wav_formula_and_flops_on_a_tiny_qwen3_omni_code2wav():
    """Exact parameters and exact FLOPs per frame.

    A forward falls short of frames x the per-frame estimate by a constant: its causal
    transposed convs trim both edges. Eager attention over a window wider than the input,
    so the counter sees the attention the estimate charges.
    """
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeCode2WavConfig,
    )
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    hf_config = Qwen3OmniMoeCode2WavConfig(
        codebook_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_quantizers=4,
        upsample_rates=(4, 3),
        upsampling_ratios=(2,),
        decoder_dim=32,
        sliding_window=128,
    )
    hf_config._attn_implementation = "eager"
    model = Qwen3OmniMoeCode2Wav(hf_config).eval()
    cfg = ComponentConfig("tiny", "code2wav", "vocoder", hf_config.to_dict())
    assert count_parameters(cfg) == numel(model)
    assert cfg.samples_per_frame == 24

    def shortfall(frames):
        measured = _measured_flops(lambda: model(torch.randint(0, 32, (1, 4, frames))))
        estimated = estimate_cost(cfg, max_batch=1, max_len=frames).flops_per_item * frames
        return estimated - measured, measured

    (short, _), (long_short, long_measured) = shortfall(16), shortfall(64)
    assert short == long_short > 0
    assert long_short / long_measured < 0.01


def test_autoencoder_kl_decode_flops_match_the_flop_counter():
    """Exact; the counter sees no CPU SDPA, so the mid-block attention is added here."""
    vae = _autoencoder_kl(**AUTOENCODERS["two-blocks"]).eval()
    latent = 8
    measured = _measured_flops(lambda: vae.decode(torch.randn(1, 4, latent, latent)))
    cfg = ComponentConfig("tiny", "vae", "vae", {"_class_name": "AutoencoderKL", **vae.config})
    cost = estimate_cost(cfg, max_batch=1, max_len=latent * latent)
    channels = AUTOENCODERS["two-blocks"]["block_out_channels"][-1]
    assert cost.flops_per_item == measured + 4 * channels * (latent * latent) ** 2


def test_byte_accounting():
    cfg = load_component_config("Qwen/Qwen2.5-7B-Instruct")
    cost = estimate_cost(cfg, max_batch=4, max_len=2048)
    # 2 x 28 layers x 4 KV heads x 128 dims x 2 bytes.
    assert cost.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    assert cost.kv_cache_bytes == 4 * 2048 * cost.kv_bytes_per_token
    assert cost.weight_bytes == 2 * cost.params
    assert cost.total_bytes == cost.weight_bytes + cost.kv_cache_bytes + cost.activation_bytes
    wide = estimate_cost(cfg, max_batch=4, max_len=2048, dtype="float32")
    assert wide.weight_bytes == 2 * cost.weight_bytes
    assert wide.kv_cache_bytes == 2 * cost.kv_cache_bytes
    assert cost.item == "token" and cost.params_source == "formula"


def test_lm_activation_workspace():
    cfg = load_component_config("Qwen/Qwen2.5-0.5B-Instruct")
    c = cfg.config
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    q_dim, kv_dim = hidden, 2 * (hidden // c["num_attention_heads"])
    per_token = (2 * hidden + 2 * q_dim + 2 * kv_dim + 3 * inter) * 2
    cost = estimate_cost(cfg, max_batch=16, max_len=4096)
    assert cost.activation_bytes == PREFILL_TOKENS * per_token + 16 * vocab * 4
    explicit = estimate_cost(cfg, max_batch=16, max_len=4096, prefill_tokens=16384)
    assert explicit.activation_bytes == 16384 * per_token + 16 * vocab * 4
    # A forward always holds one full-length prompt, however small the batching budget.
    alone = estimate_cost(cfg, max_batch=16, max_len=4096, prefill_tokens=1)
    assert alone.activation_bytes == 4096 * per_token + 16 * vocab * 4
    # A batch too small to fill a prefill chunk is capped at its own tokens.
    small = estimate_cost(cfg, max_batch=1, max_len=100)
    assert small.activation_bytes == 100 * per_token + vocab * 4


def test_codec_lm_cost_is_per_frame_with_its_code_predictor():
    cost = estimate_cost(
        load_component_config("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "talker"),
        max_batch=1,
        max_len=1,
    )
    assert cost.item == "codec frame"
    # The code predictor reuses its weights over 16 positions per frame.
    assert cost.flops_per_item > 2 * cost.active_params
    assert cost.params_source == "formula+counts"


def test_vocoder_activation_covers_one_forward_chunk():
    cfg = load_component_config("Qwen/Qwen3-Omni-30B-A3B-Instruct", "code2wav")
    chunk = estimate_cost(cfg, max_batch=2, max_len=VOCODER_FORWARD_FRAMES)
    request = estimate_cost(cfg, max_batch=2, max_len=4096)
    assert request.activation_bytes == chunk.activation_bytes > 0
    assert chunk.kv_cache_bytes == 0 and chunk.item == "codec frame"


def test_measured_catalog_flops_are_used():
    token2wav = load_component_config("Qwen/Qwen2.5-Omni-7B", "token2wav")
    assert estimate_cost(token2wav, max_batch=1, max_len=50).flops_per_item == 5.81e10
    vae = load_component_config("Qwen/Qwen-Image", "vae")
    positions = (1024 // 8) ** 2
    cost = estimate_cost(vae, max_batch=1, max_len=positions)
    assert cost.flops_per_item == pytest.approx(6.879e8 * positions)
    assert cost.params_source == "count" and cost.item == "image"


def test_text_encoder_keeps_no_kv_cache():
    cost = estimate_cost(
        load_component_config("Qwen/Qwen-Image", "text_encoder"), max_batch=2, max_len=64
    )
    assert cost.kv_cache_bytes == 0
    assert cost.params == 7_615_616_512 + 676_550_144  # language model + vision tower


def test_missing_count_is_an_error():
    cfg = ComponentConfig("local-vit", None, "vision_encoder", {"hidden_size": 8, "depth": 1})
    with pytest.raises(ModelConfigError, match="no parameter formula"):
        estimate_cost(cfg, max_batch=1, max_len=1)


def test_bad_arguments_are_errors():
    cfg = load_component_config("Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ModelConfigError, match="unknown dtype"):
        estimate_cost(cfg, max_batch=1, max_len=1, dtype="float13")
    with pytest.raises(ModelConfigError, match="max_batch"):
        estimate_cost(cfg, max_batch=0, max_len=1)


def test_checkpoint_counts_agree_with_the_formula(tmp_path):
    """A saved model's safetensors headers hold exactly the parameters the formula counts."""
    hf_config = TINY_LMS["qwen2-tied"]()
    transformers.Qwen2ForCausalLM(hf_config).save_pretrained(tmp_path)
    assert count_checkpoint_parameters(tmp_path) == count_parameters(
        via_catalog(tmp_path, hf_config)
    )

"""The scaled Qwen-Image: the published widths on the tiny tokenizer, fewer layers; a
build of it is a diffusers pipeline folder that the text-to-image pipeline runs on."""

import copy
from pathlib import Path

import torch

from omniflow.catalog.components import builtin_files, load_component_config
from omniflow.catalog.costs import count_parameters
from omniflow.compiler import compile_graph, load_graph
from omniflow.families.qwen_image.checkpoints import (
    REAL_IMAGE,
    build_scaled_image,
    scaled_image_config,
)

GRAPH = Path(__file__).parents[2] / "graphs" / "text_to_image.omni"


def test_widths_are_the_published_ones_and_depth_scales_the_layers():
    text, transformer, vae, tokenizer = scaled_image_config(0.1)
    published = builtin_files(REAL_IMAGE)
    real_text = published["text_encoder/config.json"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        assert getattr(text.text_config, key) == real_text[key], key
    assert text.text_config.num_key_value_heads == real_text["num_key_value_heads"]
    assert text.vision_config.hidden_size == real_text["vision_config"]["hidden_size"]
    assert (text.text_config.num_hidden_layers, text.vision_config.depth) == (3, 3)
    assert max(text.vision_config.fullatt_block_indexes) < text.vision_config.depth
    assert len(tokenizer) < text.text_config.vocab_size
    assert transformer == {
        **{k: v for k, v in published["transformer/config.json"].items() if k[0] != "_"},
        "num_layers": 6,
    }
    assert (transformer["num_attention_heads"], transformer["attention_head_dim"]) == (24, 128)
    assert vae["base_dim"] == 96 and vae["z_dim"] == 16


def test_full_depth_transformer_and_vae_have_the_real_parameter_counts():
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    _, transformer, vae, _ = scaled_image_config(1.0)
    for part, cls, config in (
        ("transformer", QwenImageTransformer2DModel, transformer),
        ("vae", AutoencoderKLQwenImage, vae),
    ):
        with torch.device("meta"):
            model = cls(**config)
        count = sum(p.numel() for p in model.parameters())
        assert count == count_parameters(load_component_config(REAL_IMAGE, part)), part


def _narrow(files: dict) -> dict:
    """The published config files at the tiny checkpoint's widths (a real-width build is
    ~10 GB): what the builder does to them, on a CPU in seconds."""
    files = copy.deepcopy(files)
    text = files["text_encoder/config.json"]
    # Heads of the real 128 dims: the multimodal RoPE's sections are the real model's.
    text.update(hidden_size=256, intermediate_size=128, num_attention_heads=2)
    text.update(num_key_value_heads=1, vocab_size=768, num_hidden_layers=2)
    text["vision_config"].update(hidden_size=32, intermediate_size=64, num_heads=2, depth=2)
    text["vision_config"]["out_hidden_size"] = 256
    files["transformer/config.json"].update(
        num_layers=2, num_attention_heads=2, attention_head_dim=16, joint_attention_dim=256
    )
    files["transformer/config.json"]["axes_dims_rope"] = [4, 6, 6]
    files["vae/config.json"].update(base_dim=8, num_res_blocks=1)
    return files


def test_a_build_runs_the_text_to_image_pipeline(tmp_path):
    from omniflow.runtime.interpreter import Interpreter

    out = build_scaled_image(tmp_path / "scaled", 0.5, "cpu", _narrow(builtin_files(REAL_IMAGE)))
    graph = load_graph(GRAPH).copy()
    graph.model = str(out)
    image = Interpreter(compile_graph(graph)).run(
        {"prompt": "a red boat", "negative_prompt": "grey"},
        {"steps": 2, "height": 32, "width": 32, "seed": 0},
    )["image"]
    assert image.shape == (1, 32, 32, 3) and image.dtype == torch.uint8
    # depth 0.5 of the narrowed configs' 2 layers
    transformer = load_component_config(str(out), "transformer").config
    assert transformer["num_layers"] == 1 and transformer["num_attention_heads"] == 2

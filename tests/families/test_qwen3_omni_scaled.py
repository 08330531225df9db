"""The real-size random-weight Qwen3-Omni builder (`omniflow.families.qwen3_omni.scaled`):
the published parameter counts at full depth (on the meta device), and the shard-by-shard
writer, run on the tiny config on the CPU: shards spill into a second folder when the first
is full, and the result loads through `from_pretrained` and the stages' own loaders."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple

import pytest
import torch

from omniflow.catalog import load_component_config
from omniflow.catalog.costs import count_parameters
from omniflow.errors import ModelConfigError
from omniflow.families.qwen3_omni import REAL_MODEL, scaled
from omniflow.families.qwen3_omni.checkpoints import tiny_config, tiny_tokenizer
from omniflow.families.qwen3_omni.thinker_talker import load
from omniflow.families.qwen3_omni.towers import load as load_tower

torch.set_num_threads(1)


def parts(depth: float) -> dict[str, int]:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    config, _ = scaled.scaled_config(depth)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    modules = {
        "thinker": model.thinker,
        "talker": model.talker,
        "code2wav": model.code2wav,
        "audio_tower": model.thinker.model.audio_tower,  # its own stage: not the thinker's
        "visual": model.thinker.model.visual,
    }
    counts = {part: sum(p.numel() for p in m.parameters()) for part, m in modules.items()}
    counts["thinker"] -= counts["audio_tower"] + counts["visual"]
    return counts


def test_full_depth_has_the_published_parameter_counts():
    counts = parts(1.0)
    for part, count in counts.items():
        assert count == count_parameters(load_component_config(REAL_MODEL, part)), part
    # 35.3 B parameters: 66 GiB in bf16, more than the GPU host's 64 GiB of disk.
    assert 65 * 2**30 < 2 * sum(counts.values()) < 66 * 2**30


def test_omniflow_models_build_scaled_knows_it():
    from omniflow import families

    builders = {m: path for f in families.families() for m, path in f.scaled.items()}
    assert builders[REAL_MODEL] == "omniflow.families.qwen3_omni.scaled:build_scaled"


def test_depth_scales_every_stack_and_keeps_layer_indexes_inside_it():
    config, tokenizer = scaled.scaled_config(0.25)
    thinker, talker = config.thinker_config, config.talker_config
    assert thinker.text_config.num_hidden_layers == 12 and thinker.text_config.num_experts == 128
    assert talker.text_config.num_hidden_layers == 5 and talker.text_config.vocab_size == 3072
    assert talker.accept_hidden_layer == 6  # the middle layer, as 24 of 48
    assert max(thinker.vision_config.deepstack_visual_indexes) < thinker.vision_config.depth
    assert talker.codec_eos_token_id == 2150 and talker.speaker_id["ethan"] == 2302
    assert len(tokenizer) < thinker.text_config.vocab_size
    with pytest.raises(ModelConfigError, match="depth"):
        scaled.scaled_config(1.5)


def test_shards_spill_into_another_folder_and_load_as_one_checkpoint(tmp_path, monkeypatch):
    out, spill, unneeded = tmp_path / "out", tmp_path / "shm", tmp_path / "more"
    Usage = namedtuple("Usage", "total used free")
    written = []

    def disk_usage(folder):  # `out` has room for its first two shards only
        if str(folder) == str(out):
            full = len([p for p in out.glob("*.safetensors") if not p.is_symlink()]) >= 2
            return Usage(0, 0, 0 if full else 2**40)
        return Usage(0, 0, 2**40)

    monkeypatch.setattr(scaled.shutil, "disk_usage", disk_usage)
    tokenizer = tiny_tokenizer()
    path = scaled.build_scaled(
        out,
        device="cpu",
        spill=[spill, unneeded],
        shard_bytes=300_000,
        config=tiny_config(tokenizer),
        tokenizer=tokenizer,
    )
    manifest = json.loads((path / scaled.MANIFEST).read_text())
    shards = manifest["shards"]
    assert len(shards) >= 4
    assert list(shards.values())[:2] == [str(out)] * 2
    assert set(list(shards.values())[2:]) == {str(spill)}
    assert not unneeded.exists()  # a spill folder no shard needed is not left behind
    for name, folder in shards.items():
        assert (out / name).is_symlink() == (folder == str(spill))
        written.append(name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(written)
    # save_pretrained's names: the per-expert MoE weights of the original format.
    assert "talker.model.layers.0.mlp.experts.3.up_proj.weight" in index["weight_map"]

    from transformers import Qwen3OmniMoeForConditionalGeneration

    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        path, output_loading_info=True
    )
    assert not any(info.values()) and model.dtype == torch.bfloat16
    experts = model.talker.model.layers[0].mlp.experts.gate_up_proj.float()
    assert 0.015 < experts.std() < 0.025  # initialised, as the thinker's
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert not model.thinker.lm_head.weight[ids].any()
    assert not model.talker.codec_head.weight[model.config.talker_config.codec_eos_token_id].any()
    # The stages' own loaders take it as they take the real checkpoint.
    thinker, talker = (load(str(path), part, "cpu", "auto") for part in ("thinker", "talker"))
    assert thinker.model.dtype == talker.model.dtype == torch.bfloat16
    # And the towers' (the checkpoint carries the processor's parts they read).
    hearing, vision = (load_tower(str(path), part, "auto") for part in ("audio_tower", "visual"))
    assert hearing.dtype == vision.dtype == torch.bfloat16
    shutil.rmtree(spill)

"""The scaled Qwen2.5-Omni: the real model's widths on the tiny tokenizer, fewer layers."""

import pytest
import torch

from omniflow.catalog.components import load_component_config
from omniflow.catalog.costs import count_parameters
from omniflow.errors import ModelConfigError
from omniflow.families.qwen2_5_omni.checkpoints import REAL_OMNI, scaled_omni_config


def _parts(depth: float) -> dict[str, int]:
    from transformers import Qwen2_5OmniForConditionalGeneration

    config, _, _ = scaled_omni_config(depth)
    with torch.device("meta"):
        model = Qwen2_5OmniForConditionalGeneration(config)
    modules = {
        "thinker": model.thinker,
        "talker": model.talker,
        "token2wav": model.token2wav,
        "audio_tower": model.thinker.model.audio_tower,  # its own stage: not in the thinker's count
        "visual": model.thinker.model.visual,
    }
    counts = {part: sum(p.numel() for p in m.parameters()) for part, m in modules.items()}
    counts["thinker"] -= counts["audio_tower"] + counts["visual"]
    return counts


def test_full_depth_has_the_real_models_parameter_counts():
    for part, count in _parts(1.0).items():
        assert count == count_parameters(load_component_config(REAL_OMNI, part)), part


def test_depth_scales_every_stack_and_keeps_layer_indexes_inside_it():
    config, speakers, tokenizer = scaled_omni_config(0.25)
    thinker, talker = config.thinker_config, config.talker_config
    dit = config.token2wav_config.dit_config
    assert thinker.text_config.num_hidden_layers == 7 and thinker.text_config.hidden_size == 3584
    assert talker.num_hidden_layers == 6 and talker.vocab_size == 8448
    assert max(thinker.vision_config.fullatt_block_indexes) < thinker.vision_config.depth
    assert max(dit.look_backward_layers + dit.look_ahead_layers) < dit.num_hidden_layers
    # The tokenizer's ids, and the talker-side ids after them, fit the real vocabulary.
    assert max(speakers.values()) < thinker.text_config.vocab_size
    assert len(tokenizer) < thinker.text_config.vocab_size
    assert sum(_parts(0.25).values()) < sum(_parts(1.0).values()) / 2


@pytest.mark.parametrize("depth", [0, 1.5])
def test_depth_outside_zero_to_one_is_refused(depth):
    with pytest.raises(ModelConfigError, match="depth"):
        scaled_omni_config(depth)


def test_cli_refuses_a_bad_depth_before_building(tmp_path, capsys):
    from omniflow.cli import main

    out = tmp_path / "scaled"
    assert (
        main(["models", "build-scaled", "--depth", "2", "--device", "cpu", "--out", str(out)]) == 1
    )
    assert "depth must be in (0, 1]" in capsys.readouterr().err and not out.exists()

"""What the tiny checkpoints share: seeded weights, the tiny dims of Qwen decoders, heads
that emit only real ids.

Each model family's `checkpoints` module writes its tiny checkpoint (its descriptor's
`TinyModel.build`) with the same `save_pretrained` calls a real checkpoint's authors use,
so loading it goes through exactly the code path that loads the real model. Weights are
random but seeded in a way that gives the same bytes on every machine (`seed_weights`).
`omniflow.checkpoints.tiny` runs those builds into its cache atomically.

Layout facts that users of a checkpoint need (special-token ids, codec-token offsets,
speaker tokens) are written into the checkpoint's own config files, never only kept in a
recipe.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import torch

# Bump when any recipe's output changes, so cached checkpoints are rebuilt.
RECIPE_VERSION = 3


# Shared tiny text-decoder dims (a Qwen2.5-7B decoder scaled down: 64 wide, 2 layers,
# grouped-query attention with 4 query and 2 key/value heads of 16 dims).
TEXT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
}
# Qwen2.5-VL / Omni multimodal RoPE: the 8 rotary frequency pairs of a 16-dim head split
# over (time, height, width) in the proportions of the real [16, 24, 24].
MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
# Qwen2.5-VL / Omni vision tower: 2 blocks (the last one full attention, as every 8th is
# in the real 32), real patching (14 px patches, 2 frames, 2x2 merge).
VISION_DIMS = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "fullatt_block_indexes": [1],
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
}
# Both tiny codecs: 128 codes, one codebook, 24 kHz audio.
CODEBOOK_SIZE = 128
SAMPLE_RATE = 24000


# --- seeded weights ------------------------------------------------------------------------


def portable_uniform(key: str, shape: tuple[int, ...], bound: float, center: float = 0.0):
    """float32 values uniform in [center - bound, center + bound), the same on every machine.

    Seeded by `key`. numpy's PCG64 is integer arithmetic and the affine map is exactly
    rounded IEEE arithmetic, so unlike torch's CPU `normal_` (which takes an AVX2 path on
    some machines and a scalar one on others) the bits do not depend on the machine.
    """
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    unit = np.random.Generator(np.random.PCG64(seed)).random(math.prod(shape))
    values = ((2.0 * unit - 1.0) * bound + center).astype(np.float32)
    return torch.from_numpy(values).reshape(shape)


def _fan_in(weight: torch.Tensor) -> int:
    return weight.numel() // weight.shape[0]


def seed_weights(model: torch.nn.Module, key: str) -> torch.nn.Module:
    """Redraw every randomly initialised parameter portably; return the model in eval mode.

    Constant parameters (norm weights, zero biases, Snake alphas) keep the architecture's
    own init: constants are exact on every machine. Random matrices and kernels get std
    1/sqrt(fan_in), which keeps activations near unit scale (at these widths the
    architectures' own std-0.02 inits shrink the signal layer by layer, until token2wav's
    waveform is ~1e-7 and an LM's logits are so flat that greedy decoding hangs on float
    noise). Random biases (PyTorch's default init, in diffusers models) get PyTorch's
    rule, uniform within 1/sqrt(fan_in) of their layer's weight. Scales come from shapes,
    never from measuring the machine-dependent init. Tied parameters are drawn once, so
    they stay tied.
    """
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if bool(param.min() == param.max()):
                continue
            if param.ndim >= 2:
                bound = math.sqrt(3.0 / _fan_in(param))
            elif name.endswith(".bias") and f"{name[: -len('bias')]}weight" in params:
                bound = 1.0 / math.sqrt(_fan_in(params[f"{name[: -len('bias')]}weight"]))
            else:
                raise ValueError(f"{key}: no portable init rule for random parameter '{name}'")
            param.copy_(portable_uniform(f"{key}/{name}", tuple(param.shape), bound))
    return model.eval()


def silence_rows(weight: torch.Tensor, start: int) -> None:
    """Zero an output head's rows from `start` on: ids the real model never predicts.

    Real Qwen vocabularies extend past the ids the model is trained to emit (a thinker's
    past its tokenizer, the talker's past its codec specials). Zero rows give those ids a
    logit of exactly 0, which the best of a random head's real ids beats, so greedy
    decoding emits only ids that the tokenizer or the next stage can take.
    """
    with torch.no_grad():
        weight[start:] = 0


def scale_output(layer: torch.nn.Module, gain: float) -> None:
    """Scale a vocoder's last layer so its waveform has a speech-like std of about 0.3.

    With unit-scale activations the last layer's output is tens of units wide and the
    vocoder's final clamp or tanh saturates it to +-1, where any two waveforms agree up to
    sign; `gain` is 0.3 over the std measured at the layer for this recipe's weights.
    """
    with torch.no_grad():
        for param in layer.parameters():
            param.mul_(gain)


def special_ids(tokenizer) -> dict[str, int]:
    return {token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def chat_lm(model, tokenizer):
    """A Qwen chat LM's head and generation defaults: it emits only the tokenizer's ids, ends
    at <|im_end|> or <|endoftext|>, and decodes greedily."""
    from transformers import GenerationConfig

    ids = special_ids(tokenizer)
    silence_rows(model.lm_head.weight, len(tokenizer))
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    return model

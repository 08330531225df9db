"""The tiny Qwen2.5-Instruct chat LM: `Qwen2ForCausalLM`, 2 layers, 64 wide, tied embeddings."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from omniflow.checkpoints.tiny_recipes import (
    TEXT_DIMS,
    chat_lm,
    round_up,
    seed_weights,
    special_ids,
)
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer


def build_qwen2(out: Path, heads: tuple[int, int] = (4, 2)) -> Iterator[str]:
    """`heads`: attention and key/value heads over the same 64-wide projections."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    ids = special_ids(tokenizer)
    tokenizer.save_pretrained(out)

    yield "model"
    config = Qwen2Config(
        vocab_size=round_up(len(tokenizer), 64),
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        # Qwen2.5-0.5B/1.5B tie the output head to the input embedding.
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        **{**TEXT_DIMS, "num_attention_heads": heads[0], "num_key_value_heads": heads[1]},
    )
    model = chat_lm(seed_weights(Qwen2ForCausalLM(config), "qwen2"), tokenizer)

    yield "save"
    model.save_pretrained(out)


def build_qwen2_wide_heads(out: Path) -> Iterator[str]:
    """The qwen2 weights as 2 attention heads of 32 (vLLM's CPU attention needs >= 32)."""
    return build_qwen2(out, heads=(2, 1))

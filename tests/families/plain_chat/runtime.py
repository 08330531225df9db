"""The plain-chat family's run-time half: its component for the transformers `ar` backend
(the prompt as a transcript), and its tiny checkpoint's recipe."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from omniflow.backends.transformers_ar import CausalLM, Prompt
from omniflow.checkpoints.tiny_recipes import TEXT_DIMS, chat_lm, round_up, seed_weights
from omniflow.checkpoints.tiny_tokenizer import build_tokenizer


def transcript(messages: list[dict]) -> str:
    """A chat as this family prompts its LM: one "Role: text" line a message, then the
    assistant's turn."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


class PlainChat(CausalLM):
    inputs = {"prompt": ("chat",)}

    def prompt(self, call) -> Prompt:
        ids = self.tokenizer(transcript(call.inputs["prompt"].take())).input_ids
        return Prompt(self.embed(torch.tensor(ids, device=self.embed.weight.device)), ids)


def load(path: str, component: str | None, device: str, dtype) -> PlainChat:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return PlainChat(model.to(device).eval(), AutoTokenizer.from_pretrained(path))


def build_tiny(out: Path) -> Iterator[str]:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    yield "tokenizer"
    tokenizer = build_tokenizer("qwen")
    tokenizer.save_pretrained(out)
    yield "model"
    config = Qwen3Config(
        vocab_size=round_up(len(tokenizer), 64),
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **TEXT_DIMS,
    )
    model = chat_lm(seed_weights(Qwen3ForCausalLM(config), "plain-chat"), tokenizer)
    yield "save"
    model.save_pretrained(out)

"""Qwen2.5-VL's language model as a component of the transformers `ar` backend: a chat
prompt plus the image embeddings of a vision encoder stage (`omniflow.backends.vision`).

It reproduces what `Qwen2_5_VLForConditionalGeneration.generate` does on the inputs
`Qwen2_5_VLProcessor` makes, with the vision tower's work done by another stage:

- the prompt: the chat through the tokenizer's chat template, with the image where the
  chat puts an image part (`{"type": "image"}`); a chat with none gets the image first in
  its last user message, as Qwen's examples write it. As the processor does, the
  template's one image token (`<|image_pad|>`) per image is expanded to one per image embedding
  (grid t * h * w / merge_size²);
- the prefill's input embeddings: the token embeddings, with the image embeddings in
  place of the `<|image_pad|>` tokens' (the model's `masked_scatter`);
- positions: Qwen2.5-VL's multimodal RoPE. The prefill's `[3, 1, L]` position ids come
  from the model's own `get_rope_index(input_ids, mm_token_type_ids, image_grid_thw)`,
  which gives an image's tokens (time, row, column) positions; each decode step's position
  is the cache length plus that request's rope delta (the prompt's largest position + 1
  minus its length), as `generate` adds `rope_deltas`.

A request without an image (no `embeds` input, or an empty one) is a plain chat: the
template, 1-D positions, no delta.

Loading: transformers has no Qwen2.5-VL class with the language model and its head but
not the vision tower, so `Qwen2_5_VLForConditionalGeneration.from_pretrained` loads the
whole checkpoint and the tower is deleted at once: the encoder stage runs it.
"""

from __future__ import annotations

import torch

from omniflow.backends.transformers_ar import ARBackendError, CausalLM, Component, Prompt
from omniflow.backends.vision import unpack_image
from omniflow.runtime.stage import Call

_COMPONENT = "language_model"
# Qwen's mm_token_type_ids: 0 text, 1 image.
_TEXT, _IMAGE = 0, 1


def load(path: str, component: str | None, device: str, dtype) -> Component:
    """The language model of the Qwen2.5-VL checkpoint at `path`, without its vision tower."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    if component != _COMPONENT:
        raise ARBackendError(
            f"Qwen2.5-VL has no '{component}' language model; use component=\"{_COMPONENT}\" "
            '(the vision tower runs on an encoder stage, component="visual")'
        )
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=dtype, output_loading_info=True
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ARBackendError(f"{path}: the language model lacks weights {', '.join(missing[:5])}")
    del model.model.visual
    return QwenVLLanguageModel(model.to(device).eval(), AutoTokenizer.from_pretrained(path))


def with_image_parts(messages: list[dict], images: int) -> list[dict]:
    """The chat with one image part per image: as given when it has that many, else (one
    image, no image part) the image first in the last user message."""
    parts = [
        part.get("type")
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    ]
    other = sorted({str(p) for p in parts} - {"text", "image"})
    if other:
        raise ARBackendError(f"this stage takes text and image chat parts, not {', '.join(other)}")
    given = parts.count("image")
    if given == images:
        return messages
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if given or images != 1 or not users:
        raise ARBackendError(
            f"the chat has {given} image part(s) and the request brings {images} image(s)"
        )
    messages = [dict(m) for m in messages]
    last = messages[users[-1]]
    content = last.get("content") or []
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    last["content"] = [{"type": "image"}, *content]
    return messages


class QwenVLLanguageModel(CausalLM):
    """Qwen2.5-VL's decoder on a chat and, optionally, one image's embeddings."""

    inputs = {"prompt": ("chat",), "embeds": ("hidden",)}
    required = frozenset({"prompt"})

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.image_id = model.config.image_token_id
        self.media_ids = {"image": self.image_id}
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_id)
        self.merge_size = model.config.vision_config.spatial_merge_size
        self.rope_index = model.model.get_rope_index

    def can_start(self, call: Call) -> bool:
        return call.inputs_ended()

    def prompt(self, call: Call) -> Prompt:
        images = []
        if "embeds" in call.inputs and (value := call.inputs["embeds"].take()) is not None:
            images.append(unpack_image(value, self.merge_size))
        messages = with_image_parts(call.inputs["prompt"].take(), len(images))
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        pieces = text.split(self.image_token)
        if len(pieces) != len(images) + 1:
            raise ARBackendError(
                f"the prompt has {len(pieces) - 1} {self.image_token} tokens for "
                f"{len(images)} image(s)"
            )
        text = pieces[0] + "".join(
            self.image_token * len(embeds) + piece
            for (embeds, _), piece in zip(images, pieces[1:], strict=True)
        )
        device = self.embed.weight.device
        host_ids = torch.tensor(self.tokenizer(text).input_ids)
        ids = host_ids.to(device)
        embeds = self.embed(ids)
        if not images:
            return Prompt(embeds, host_ids.tolist())
        image_rows = ids == self.image_id
        pixels = torch.cat([e for e, _ in images]).to(device, embeds.dtype)
        embeds = embeds.masked_scatter(image_rows[:, None], pixels)
        # On the host, as Qwen2.5-Omni's thinker does (its `prompt` says why).
        host_rows = host_ids == self.image_id
        positions, delta = self.rope_index(
            host_ids[None],
            mm_token_type_ids=torch.where(host_rows, _IMAGE, _TEXT)[None],
            image_grid_thw=torch.cat([grid for _, grid in images]).cpu(),
        )
        return Prompt(embeds, host_ids.tolist(), positions.to(device), int(delta))

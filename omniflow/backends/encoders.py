"""The text encoder backend of `encoder` stages: `TextEncoder`, a diffusers pipeline's own
prompt encoding (`backend="diffusers"`; an encoder of images runs on
`omniflow.backends.vision`).

The pipeline's own `encode_prompt` does the work. For Qwen-Image: the prompt goes into the
pipeline's chat template, the Qwen2.5-VL text encoder's last hidden states are taken, the
template's system-prefix tokens are dropped, and each prompt keeps its own length, at most
the stage's `max_len` tokens (1024 unless the program says otherwise; the pipeline's
`__call__` cuts at 512, so only longer prompts differ from its default). One forward
encodes every prompt of a batch; on a guidance path (`call.params["cfg"]`, the negative
prompt's text) it encodes the negative prompt too, whatever the guidance scale — this stage
does not see it — unless the family says the request has none (Qwen-Image: an empty
negative prompt is none, and the request is unguided, as `__call__` without one is; Wan
encodes the empty negative prompt, as its `__call__` does). The family's `encode` does the
work: Wan's is its pipeline's UMT5 encoding, its embeddings zero-padded to `max_len` as the
pipeline pads them (its transformer attends to the padding).

Qwen-Image-Edit's stage also takes the request's input `image`: its template puts the
image before the prompt, and its Qwen2VLProcessor shows the image, resized as the
pipeline's `__call__` resizes it (`condition_image`), to the text encoder, for the prompt
and the negative prompt alike. The image's tokens are kept in the embeddings, and the
pipeline cuts nothing, so a request whose embeddings outgrow the plan's item (the image's
tokens plus `max_len`) fails rather than be cut.

What a request emits on `hidden`, in the text encoder's dtype, is one value
`[k, 1 + n, H]` (`pack_prompts` in `omniflow.backends.diffusion` writes it and
`unpack_prompts` reads it):

- k = 1 (the prompt) or 2 (the prompt, then the negative prompt on a guidance path);
- n is the longer of the two prompts' token counts;
- row i, position 0 is a header: `[i, 0, 0]` = n_i % 256 and `[i, 0, 1]` = n_i // 256,
  n_i being that prompt's token count (small integers, exact in every float dtype); the
  rest of the header is zero;
- row i, positions 1 .. n_i are its embeddings, and the positions after them are zero.

The denoiser turns the header back into each row's length and the attention mask its
transformer needs when rows of different lengths share a forward.
"""

from __future__ import annotations

import torch

from omniflow.backends.diffusion import (
    DiffusersBackendError,
    condition_image,
    edits,
    load_pipeline,
    pack_prompts,
    pipeline_code,
)
from omniflow.runtime.stage import Backend, Call, StageSpec


class TextEncoder(Backend):
    """A diffusers pipeline's text encoder: prompt (and negative prompt), with an edit
    pipeline's input image, to embeddings (its family's `encode`)."""

    def __init__(self, spec: StageSpec, device: str):
        super().__init__(spec, device)
        name = spec.plan.name
        if spec.inputs not in ({"prompt": "text"}, {"prompt": "text", "image": "image"}):
            given = ", ".join(f"{p}: {t}" for p, t in spec.inputs.items())
            raise DiffusersBackendError(
                f"stage '{name}': the diffusers text encoder takes one text prompt (and, for an "
                f"edit pipeline, an image), not {given}"
            )
        self.code = pipeline_code(spec)
        parts = ("text_encoder", "tokenizer", "processor")
        self.pipe = load_pipeline(spec, device, parts, self.code)
        self.edits = edits(spec, self.pipe, self.code)
        self.max_len = spec.plan.settings["max_len"]
        limit = self.code.max_text_len(self.pipe)
        if not 1 <= self.max_len <= limit:
            raise DiffusersBackendError(
                f"stage '{name}': max_len must be 1..{limit} for this pipeline, not {self.max_len}"
            )
        # Embeddings a request may emit: the plan's item, less its header row.
        self.max_rows = spec.outputs["hidden"].shape[0] - 1

    def ready(self, call: Call) -> bool:
        return call.inputs_ended()

    def step(self, calls: list[Call]) -> None:
        texts: list[str] = []
        images: list = []
        owners: list[tuple[Call, range]] = []
        for call in calls:
            negative = call.params.get("cfg")
            try:
                if negative is not None and not isinstance(negative, str):
                    raise DiffusersBackendError(
                        "the guidance companion must be a text (a negative prompt), not "
                        f"{type(negative).__name__}"
                    )
                negative = self.code.negative_prompt(negative)
                image = (
                    condition_image(self.pipe, self.code, call.inputs["image"].take())
                    if self.edits
                    else None
                )
            except DiffusersBackendError as err:
                call.fail(err)
                continue
            # An empty text stream is the empty prompt.
            mine = [call.inputs["prompt"].take() or ""]
            mine += [] if negative is None else [negative]
            owners.append((call, range(len(texts), len(texts) + len(mine))))
            texts += mine
            images += [image] * len(mine)
        if not texts:
            return
        with torch.no_grad():
            embeds = self.code.encode(
                self.pipe, texts, images if self.edits else None, self.max_len, self.device
            )
        for call, rows in owners:
            longest = max(embeds[i].shape[0] for i in rows)
            if longest > self.max_rows:
                call.fail(
                    DiffusersBackendError(
                        f"the prompt and image make {longest} embeddings; the stage was planned "
                        f"for {self.max_rows} (raise its max_len)"
                    )
                )
                continue
            call.emit("hidden", pack_prompts([embeds[i] for i in rows]))
            call.finish()

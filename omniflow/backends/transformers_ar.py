"""The transformers backend of `ar` stages: `TransformersAR`, continuous batching over a
Hugging Face decoder with per-request sampling, streaming tokens, text, hidden states and
codec tokens.

What it owns:

- Loading: `load_component` loads the model-specific half of the backend (a `Component`)
  that the stage's model family gives it (the plan's `StagePlan.family`: e.g. the thinker
  or the talker of an omni model, a vision-language model's LM on image embeddings, a
  codec LM); a model no family gives code for is a plain causal LM (`CausalLM`,
  `AutoModelForCausalLM`). Each loads through
  `from_pretrained` on the checkpoint directory, in the checkpoint's dtype (or the stage's
  `dtype=`), in eval mode, then moves to the stage's device.
- The batched KV cache. Every running request is one row of a single `DynamicCache`; rows
  are left-padded to a common length and an attention mask says which columns of each row
  hold its own positions, while explicit position ids give each row its true positions
  (0, 1, 2, ... unless the component's `Prompt` says otherwise: multimodal RoPE).
  New requests are prefilled together: their prompts, right-padded to the longest, run as
  one causal forward (a real position never attends to a pad, which only follows it, so no
  padding mask is needed), as many as fit the stage's `prefill_tokens` (padded positions;
  a longer prompt runs alone); one request's prefill is the same computation as `generate`
  on it. Each then joins: its cache is left-padded (or the others are) and concatenated.
  A decode step is ONE forward over every row; a row that is not advancing this step (a
  talker waiting for its next conditioning row) gets a masked dummy column, so nothing is
  copied per step beyond what `DynamicCache` itself does. Finished rows leave by row
  selection, and columns no remaining row uses are cut off. Joining and leaving copy the
  cache once; stacking per-request caches every step would copy it every token.
- Sampling per request: temperature (0 = greedy), top-k, top-p, repetition penalty (over
  the prompt and the output, as transformers applies it), a per-request `torch.Generator`
  seeded with `seed`, `max_tokens`, stop token ids and stop strings, the model's EOS ids
  and suppressed ids. Missing parameters come from the model's generation defaults, else
  from the `ar` kind's defaults.
- Decode on a static cache (`decode`: "graphs", the default on CUDA, or "static"): every
  request owns a slot of a KV cache pre-allocated at load, sized from the stage's budget
  (`cache_columns`), and a decode step is replayed from CUDA graphs captured at load, the
  decoder's step at its batch bucket (and length bucket where torch's attention reads the
  cache) and the step's finish (sampling, frames) at its batch bucket
  (`omniflow.backends.static_decode`); prefill: where the step is fused, the fused layers
  over the prompts' positions write straight into the slots (`StaticDecoder.prefill`,
  replayed from a (batch, width) bucket's graph where the prompts have no positions of
  their own), else the forward above, whose cache is then copied
  into the request's slot; the prefilled requests' first tokens are then sampled by the
  static step's own head and sampler, the finish's graph (`StaticDecoder.first`), so a
  first token takes the draws, masks and read-back every later one does, and like a
  step's is emitted once it has landed, never waited for. The step's inputs, sampling
  parameters and seen masks live on the device; a step writes which rows advance and
  reads back the sampled ids. Each step is launched before the previous one's tokens are
  emitted, so the host's work of a step (emitting, detokenizing, bookkeeping) runs while
  the device computes the next: a row that ends at step t has step t+1 computed and
  discarded, and a request dropped while a step is in flight loses that step's token. A
  codec LM whose steps emit frames of several codebooks takes this path where its component
  gives a `frame_spec`: the step completes each frame on the device (its second decoder's
  sub-steps and their sampling, inside the finish's graph; a prefill's first frames inside
  its first step's) and reads the frame's codes back with the ids.
  `decode="eager"` (the default on CPU) is the batched `DynamicCache` path above,
  token-identical to `generate`.
- Streaming: per generated token, `tokens` `[1, 1]` int64, `codes` `[1, Q]` (codec LMs),
  `hidden` (the component says what: the last hidden state `[1, 1, H]` for a plain LM), and
  `text` pieces from `TextStream`, which never splits a UTF-8 character and holds back what
  could still become a stop string.
"""

from __future__ import annotations

import functools
import math
import os
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from omniflow.backends import static_decode
from omniflow.backends.registry import family_code
from omniflow.backends.sampling_params import Sampling, neutral_defaults
from omniflow.catalog.resolve import model_path
from omniflow.dtypes import torch_dtype
from omniflow.errors import OmniflowError
from omniflow.hf_logging import quiet
from omniflow.ir.values import Param
from omniflow.kernels.sampling import sample
from omniflow.runtime.doorbells import Ending
from omniflow.runtime.readback import IN_FLIGHT, upload
from omniflow.runtime.slack import Playback, can_wait, urgent_first
from omniflow.runtime.stage import Backend, Call, StageSpec

# Where a request's decoding state lives in `call.state`.
_STATE = "ar"


class ARBackendError(OmniflowError):
    """An `ar` stage cannot load its model, or a request cannot run on it."""


# --- model-specific halves -------------------------------------------------------------------


@dataclass
class Prompt:
    """What a request's prefill feeds the decoder.

    Position ids default to 0 .. L-1 for the prompt and the cache length for each decode
    step. A model whose positions are not those (Qwen2.5-VL's multimodal RoPE gives an
    image's tokens 3-D positions) sets `positions` and the offset every decode position
    gets on top of the cache length. A model whose decoder takes more than embeddings at
    a prefill (features it adds inside its layers at the prompt's image positions) sets
    `prefill`, which its component's `prefill_inputs` turns into keyword arguments of the
    decoder's forward for the prompts prefilled together.
    """

    embeds: torch.Tensor  # [L, E] input embeddings
    context: list[int]  # ids the repetition penalty counts as already seen
    positions: torch.Tensor | None = None  # the prefill's position ids, [1, L] or [3, 1, L]
    position_offset: int = 0  # decode position = cache length + this
    prefill: Any = None  # the component's own, read by its `prefill_inputs`


class Component(ABC):
    """The model-specific half of the backend: how a request's inputs become decoder inputs,
    and what its `hidden` output carries. Subclasses set the attributes in `__init__`."""

    inputs: dict[str, tuple[str, ...]]  # input port -> types it accepts
    required: frozenset[str]
    outputs: frozenset[str]
    model: torch.nn.Module
    decoder: torch.nn.Module  # forward(inputs_embeds, attention_mask, position_ids, cache, ...)
    head: torch.nn.Module
    embed: torch.nn.Module
    tokenizer = None
    eos_ids: frozenset[int]
    suppress: tuple[int, ...] = ()
    # The end ids are masked while fewer tokens than this were generated (min_new_tokens).
    min_tokens: int = 0
    # Every prompt carries position ids (`Prompt.positions`: multimodal RoPE), so the static
    # path's lone-prompt prefill graphs would never replay: none are captured.
    prompt_positions: bool = False
    # A codec LM whose step emits a frame of several codebooks: how its frames are completed
    # (None: a frame, if any, is the sampled token's `code`), on the device inside the static
    # step, and by `frames` (`complete_frames`) and `step_embeds` on the dynamic path: the
    # frame's codes, and as the next step's input the frame's summed codebook embeddings
    # (`static_decode.summed_codebooks`) plus `step_extra`'s row; a request's `ahead_codes`
    # go out as it starts, before its prefill.
    frame_spec: static_decode.FrameSpec | None = None
    defaults: dict  # sampling defaults of the model (subset of SAMPLING_KEYS)
    # The placeholder token of each media kind a model puts into its prompt (an image's rows
    # go where its tokens are): `media_counts` counts them in its prompt for the usage.
    media_ids: dict[str, int] = {}

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def media_counts(self, ids: list[int]) -> dict[str, int]:
        """The placeholder tokens of each media kind in prompt `ids` (every kind it takes, 0
        included): what a reply's usage reports of them."""
        return {kind: ids.count(token) for kind, token in self.media_ids.items()}

    def project(self, embeds: torch.Tensor) -> torch.Tensor:
        """Input embeddings -> what the decoder stack takes."""
        return embeds

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def prefill_inputs(self, prompts: list[Prompt], width: int) -> dict:
        """Keyword arguments of the decoder's forward beside the embeddings for one prefill
        of `prompts`, right-padded to `width` positions (row i is prompts[i]), from their
        `prefill` values: by default none. Decode steps take none."""
        return {}

    def receive(self, calls: list[Call]) -> None:  # noqa: B027 (optional hook)
        """Take the streamed input that has arrived for the step's requests (a talker's
        conditioning), all at once."""

    def has_news(self, call: Call) -> bool:
        """Whether streamed input is waiting to be taken."""
        return False

    def in_flight(self) -> bool:
        """Whether streamed input is on its way to the host (the loop keeps polling)."""
        return False

    @abstractmethod
    def can_start(self, call: Call) -> bool:
        """Whether the request's prompt (or first conditioning) is complete."""

    @abstractmethod
    def prompt(self, call: Call) -> Prompt:
        """What the request's prefill feeds the decoder (raises ARBackendError if it cannot)."""

    def prompts(self, calls: list[Call]) -> list[Prompt | OmniflowError]:
        """The prompts of requests starting together, each or the error it cannot start
        with: by default `prompt` of each (a component may build them together)."""
        return [_or_error(self.prompt, call) for call in calls]

    def can_step(self, seq: Sequence) -> bool:
        return True

    def step_embeds(self, seqs: list[Sequence]) -> torch.Tensor:
        """[n, E]: the input embedding of each sequence's next decode step: the embedding of
        the id it sampled last (with a `frame_spec`, its last frame's summed codebooks), plus
        `step_extra`'s row if the component has one."""
        if self.frame_spec is not None:
            embeds = torch.stack([s.frame_input for s in seqs])
        else:
            embeds = self.embed(
                torch.tensor([s.last for s in seqs], device=self.embed.weight.device)
            )
        extra = self.step_extra(seqs)
        return embeds if extra is None else embeds + extra

    def step_extra(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """[n, E] added to each sequence's last-id embedding (with a `frame_spec`, its last
        frame's embeddings) in its next decode step, or None (nothing added); the step is
        the sequence's `next_step`. The static decode path calls only this, so a component
        whose step inputs are not this sum overrides `step_embeds` and decodes eagerly."""
        return None

    def code(self, token: int) -> torch.Tensor | None:
        """The `codes` output `[1, Q]` of a sampled token (None: emit none): by default the
        token id as sampled."""
        return torch.tensor([[token]])

    def frames(
        self, seqs: list[Sequence], ids: list[int], hidden: torch.Tensor
    ) -> list[torch.Tensor | None]:
        """The `codes` outputs of the tokens `ids` that `seqs` just sampled from their last
        hidden states `hidden` `[n, H]`, one per sequence: by default each token's `code`;
        with a `frame_spec`, each frame completed by its second decoder (`complete_frames`,
        the batch at once; none for an end id), each sequence's next input kept
        (`Sequence.frame_input`). The static decode path never calls this: its steps, and
        the first step after a prefill, emit `code`, or the frames they completed on the
        device."""
        spec = self.frame_spec
        if spec is None:
            return [self.code(token) for token in ids]
        out: list[torch.Tensor | None] = [None] * len(ids)
        rows = [i for i, token in enumerate(ids) if token not in self.eos_ids]
        if not rows:
            return out
        sub = [seqs[i] for i in rows]
        first = torch.tensor([ids[i] for i in rows], device=hidden.device)
        codes = complete_frames(spec, self.embed, hidden[rows], first, sub)
        inputs = static_decode.summed_codebooks(self.embed, spec.tables, codes)
        host = codes.cpu()  # one read-back for the batch
        for j, (i, seq) in enumerate(zip(rows, sub, strict=True)):
            seq.frame_input = inputs[j]
            out[i] = host[j : j + 1]
        return out

    def ahead_codes(self, seq: Sequence) -> torch.Tensor | None:
        """Codes a request sends on `codes` as it starts, before its prefill and no part of
        its stream (`Call.emit`'s `ahead`: outside the edge's chunk schedule), e.g. context
        its vocoder decodes, and plays nothing of, while the prefill runs; by default none."""
        return None

    def mask_logits(self, seqs: list[Sequence], logits: torch.Tensor) -> None:  # noqa: B027
        """Per-request changes to a step's logits `[n, V]` before sampling, in place; by
        default none (a minimum length is `min_tokens`). The static decode path samples on
        the device without it, so a component that masks decodes eagerly."""

    def hidden_value(self, hidden: torch.Tensor, embeds: torch.Tensor, prompt: bool):
        """The `hidden` output of one forward of one request, from its last-layer hidden
        states `[L, H]` and input embeddings `[L, E]` at the positions it fed: by default the
        last position's hidden state (the one its new token was sampled from), `[1, 1, H]`."""
        return hidden[-1:, None].clone()

    def prompt_value(self, hidden: torch.Tensor, prompt: Prompt):
        """The `hidden` output of one request's prefill, from its last-layer hidden states
        `[L, H]` at its prompt's positions: by default `hidden_value` of them with the
        prompt's input embeddings (a component whose prompts carry more says more)."""
        return self.hidden_value(hidden, prompt.embeds, prompt=True)

    def hidden_rows(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """The `hidden` outputs of one decode step of n requests, from their last hidden
        states `[n, H]` and input embeddings `[n, E]`: row i's value is `[i : i + 1]`, the
        same as `hidden_value` of that row alone."""
        return hidden[:, None].clone()


class CausalLM(Component):
    """A decoder-only text LM: its prompt is a chat (through the tokenizer's chat
    template), a text or token ids; each step feeds the token sampled last."""

    inputs = {"prompt": ("chat", "text", "tokens")}
    required = frozenset({"prompt"})
    outputs = frozenset({"tokens", "text", "hidden"})

    def __init__(self, model, tokenizer):
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self.tokenizer = tokenizer
        config = model.generation_config
        self.eos_ids = frozenset(_as_ids(config.eos_token_id))
        self.suppress = tuple(config.suppress_tokens or ())
        self.defaults = generation_defaults(config)

    def can_start(self, call: Call) -> bool:
        return call.inputs["prompt"].ended

    def prompt(self, call: Call) -> Prompt:
        stream = call.inputs["prompt"]
        ids = prompt_ids(self.tokenizer, stream.take(), stream.type, self.head.out_features)
        return Prompt(self.embed(upload(ids, self.embed.weight.device)), ids)


def _or_error(build: Callable[[Call], Prompt], call: Call) -> Prompt | OmniflowError:
    """`build(call)`, or the OmniflowError it raised (the request fails with it)."""
    try:
        return build(call)
    except OmniflowError as err:
        return err


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def generation_defaults(config) -> dict:
    """Sampling defaults a transformers `GenerationConfig` sets (`do_sample=False`: greedy)."""
    defaults = {
        key: getattr(config, key)
        for key in ("temperature", "top_p", "top_k", "repetition_penalty")
        if getattr(config, key) is not None
    }
    if config.do_sample is False:
        defaults["temperature"] = 0.0
    return defaults


def prompt_ids(tokenizer, value, port_type: str, vocab_size: int) -> list[int]:
    """Token ids of a prompt: a chat through the chat template (with the generation prompt),
    a text as it tokenizes, token ids as given."""
    if port_type == "tokens":
        ids = [int(i) for i in torch.as_tensor(value).reshape(-1).tolist()]
    elif port_type == "text":
        ids = tokenizer(value).input_ids
    else:
        for message in value:
            content = message.get("content")
            if isinstance(content, list) and any(p.get("type") != "text" for p in content):
                kinds = sorted({p.get("type") for p in content} - {"text"})
                raise ARBackendError(
                    f"this stage takes text-only chats; a message has {', '.join(map(str, kinds))} parts"
                )
        text = tokenizer.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text).input_ids
    if not ids:
        raise ARBackendError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ARBackendError(
            f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})"
        )
    return ids


def load_component(spec: StageSpec, device: str) -> Component:
    """The stage's model, loaded the way a real checkpoint loads, as a `Component`: the one
    its model family's code loads (called with the checkpoint path, the component, the
    device and the dtype), else a `CausalLM`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plan = spec.plan
    path = model_path(plan.model)
    dtype = plan.settings.get("dtype")
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else "auto"
    try:
        with quiet():
            loader = family_code(spec, "transformers")
            if loader is not None:
                return loader(path, plan.component, device, dtype)
            if plan.component is not None:
                raise ARBackendError(
                    f"{plan.model} has no component '{plan.component}' this backend knows "
                    "(no model family gives code for its parts)"
                )
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise ARBackendError(f"cannot load {plan.model}: {err}") from err
    return CausalLM(model.to(device).eval(), tokenizer)


# --- sampling ----------------------------------------------------------------------------------


def _sample_row_by_row(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """transformers' own sampling, row by row: what `generate` draws from each request's
    generator (the CPU path, token-identical to the HF models)."""
    chosen = []
    for row, seq in zip(logits, seqs, strict=True):
        sampling = seq.sampling
        if seq.seen is not None:
            penalty = sampling.repetition_penalty
            row = torch.where(seq.seen, torch.where(row < 0, row * penalty, row / penalty), row)
        if seq.generator is None:
            chosen.append(row.argmax())
        else:
            probs = _warp(row, sampling).softmax(-1)
            chosen.append(torch.multinomial(probs, 1, generator=seq.generator)[0])
    return torch.stack(chosen).tolist()


def _sample_on_device(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The whole batch in one pass of the fused sampler (omniflow.kernels.sampling): the same
    filters as `_warp`, each request's draws from its (seed, step) stream; only the ids come
    back to the host."""
    seen = None
    if any(s.seen is not None for s in seqs):
        blank = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        seen = torch.stack([blank if s.seen is None else s.seen for s in seqs])

    def rows(values: list) -> torch.Tensor:
        return torch.tensor(values, device=logits.device)

    ids = sample(
        logits.float(),
        temperature=rows(
            [s.sampling.temperature if s.generator is not None else 0.0 for s in seqs]
        ),
        top_k=rows([s.sampling.top_k for s in seqs]),
        top_p=rows([s.sampling.top_p for s in seqs]),
        repetition_penalty=rows([s.sampling.repetition_penalty for s in seqs]),
        seed=rows([s.seed for s in seqs]),
        step=rows([s.generated for s in seqs]),
        seen=seen,
    )
    return ids.tolist()


def sub_sampling(temperature: float, top_k: int, top_p: float) -> Sampling:
    """How a frame's second model (a code predictor) samples: warpers only (no penalty,
    no length, no stop)."""
    return Sampling(float(temperature), float(top_p), int(top_k), 1.0, 0, None, frozenset(), ())


def sample_sub_step(
    logits: torch.Tensor,
    seqs: list[Sequence],
    sampling: Sampling | None,
    sub_step: int,
    on_device: bool | None = None,
) -> torch.Tensor:
    """One sub-step of the model that completes the frames a codec LM's step sampled (a
    code predictor's codebook `sub_step`), for every row of the step at once: each row's
    id `[n]`, on the logits' device. Greedy where the request decodes greedily or
    `sampling` is None; else drawn with `sampling`'s warpers, as the LM's own draws are:
    on CPU from the request's generator, right after its LM draw (what `generate` does),
    row by row; on CUDA in one pass of the fused sampler, keyed by the request's seed and
    (frame, sub-step) as the static step's frames are (`static_decode.FrameCompleter`), so
    no id leaves the device (`on_device` picks the path; the fused sampler's torch
    reference runs it on CPU)."""
    if logits.is_cuda if on_device is None else on_device:
        rows = functools.partial(torch.tensor, device=logits.device)
        greedy = sampling is None
        return sample(
            logits.float(),
            temperature=rows(
                [0.0 if greedy or s.generator is None else sampling.temperature for s in seqs]
            ),
            top_k=-1 if greedy else sampling.top_k,
            top_p=1.0 if greedy else sampling.top_p,
            seed=rows([static_decode.sub_stream(s.seed) for s in seqs]),
            step=rows([s.generated * static_decode.MAX_SUB_STEPS + sub_step for s in seqs]),
        )
    chosen = []
    for row, seq in zip(logits, seqs, strict=True):
        if sampling is None or seq.generator is None:
            chosen.append(row.argmax())
        else:
            probs = _warp(row, sampling).softmax(-1)
            chosen.append(torch.multinomial(probs, 1, generator=seq.generator)[0])
    return torch.stack(chosen)


@torch.inference_mode()
def complete_frames(
    spec: static_decode.FrameSpec,
    embed: torch.nn.Module,
    hidden: torch.Tensor,
    first: torch.Tensor,
    seqs: list[Sequence] | None = None,
) -> torch.Tensor:
    """Codebooks `[n, G]` of n frames on the dynamic path, as `spec` says (what the static
    step's `FrameCompleter` computes on the device): `first` (codebook 0, fed through the
    LM's `embed`) and what the second decoder gives for 1..G-1 from each row's LM hidden
    state `[n, H]`, sub-step by sub-step over a DynamicCache, all rows in each forward
    (their positions agree: no padding). Greedy without `seqs`; else each row as its
    request samples (`sample_sub_step` with the spec's sampling)."""
    from transformers import DynamicCache

    predictor = spec.predictor
    cache = DynamicCache(config=predictor.config)

    def forward(embeds: torch.Tensor, start: int) -> torch.Tensor:
        """The last position's hidden states of LM-wide `embeds` `[n, L, H]` at start.."""
        positions = torch.arange(start, start + embeds.shape[1], device=embeds.device)
        out = predictor(
            inputs_embeds=spec.project(embeds),
            position_ids=positions[None].expand(len(embeds), -1),
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state[:, -1]

    states = forward(torch.stack([hidden, embed(first)], dim=1), 0)
    codes = [first]
    for g in range(1, spec.groups):
        logits = spec.heads[g - 1](states).float()
        code = (
            logits.argmax(-1) if seqs is None else sample_sub_step(logits, seqs, spec.sampling, g)
        )
        codes.append(code)
        if g < spec.groups - 1:
            states = forward(spec.tables[g - 1](code)[:, None], g + 1)
    return torch.stack(codes, dim=1)


def _warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p, as transformers' logits warpers do."""
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - sampling.top_p
        drop[-1] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(0, order, drop), -float("inf"))
    return logits


# --- streaming text ----------------------------------------------------------------------------


class TextStream:
    """Incremental detokenization of one request's tokens.

    Decodes a window of recent tokens (as vLLM does, so tokenizers whose text for a token
    depends on the one before still decode right) and releases text only when it does not
    end in an incomplete UTF-8 sequence (U+FFFD). With stop strings, the last
    `len(longest stop) - 1` characters are held back until they cannot start one; a stop
    string cuts the text before it. The pieces concatenate to the decoded full text.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window start; tokens already turned into text
        self.text = ""
        self.sent = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _catch_up(self, final: bool) -> None:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            scanned = len(self.text)  # holds no stop string: only one ending after it is new
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            starts = (max(0, scanned - len(s) + 1) for s in self.stops)
            found = [i for i in map(self.text.find, self.stops, starts) if i >= 0]
            if found:
                self.text = self.text[: min(found)]
                self.stopped = True

    def _release(self, upto: int) -> str:
        piece = self.text[self.sent : max(self.sent, upto)]
        self.sent += len(piece)
        return piece

    def add(self, token: int) -> str:
        """Take a token; the text that can go out now."""
        self.ids.append(token)
        self._catch_up(final=False)
        return self._release(len(self.text) if self.stopped else len(self.text) - self.hold)

    def close(self) -> str:
        """The rest of the text, incomplete characters and all (the request ended)."""
        if not self.stopped:
            self._catch_up(final=True)
        return self._release(len(self.text))


# --- the backend ---------------------------------------------------------------------------------


@dataclass(eq=False)
class Sequence:
    """One running request: its sampling state and where it stands."""

    call: Call
    sampling: Sampling
    generator: torch.Generator | None
    seen: torch.Tensor | None  # [V] bool: ids the repetition penalty applies to
    text: TextStream | None
    length: int = 0  # its positions in the KV cache
    position_offset: int = 0  # its next position id minus `length`
    prompt_tokens: int = 0  # its prompt's positions
    media: dict[str, int] = field(default_factory=dict)  # its prompt's (`media_counts`)
    generated: int = 0
    last: int = -1  # the id sampled last
    seed: int = 0  # the GPU sampler's stream: (seed, generated) picks each draw
    slot: int = -1  # on the static path: its slot (= its row) in the static cache; -1: gone
    ahead: int = 0  # decode steps launched whose tokens are not emitted yet (static path)
    first_ahead: bool = False  # its first token launched and not emitted yet (static path)
    # Its audio as its listener hears it, where a step plays for a known time (slack.py).
    playback: Playback = field(default_factory=lambda: Playback(time.monotonic()))
    frame_input: torch.Tensor | None = None  # [E]: its last frame's embeddings (dynamic path)

    @property
    def next_step(self) -> int:
        """The index of the decode step launched next: tokens emitted plus those in flight
        (its first token takes no column: `ahead` counts the steps, which do)."""
        return self.generated + self.ahead + self.first_ahead


@dataclass
class _Launch:
    """A static decode step in flight: the rows that advance in it, their slots at launch
    (its ids are read by those), and their `hidden` values, copied at launch; or, with
    `values`, a prefill's first tokens (`StaticDecoder.first`), the requests' prompt
    values to emit with them. `order`: when it was queued among the others."""

    seqs: list[Sequence]
    slots: list[int]
    launched: static_decode.Launched
    hidden: torch.Tensor | None
    order: int
    values: list | None = None


class TransformersAR(Backend):
    """An `ar` stage on transformers: continuous batching with one KV cache row per request."""

    def __init__(self, spec: StageSpec, device: str, component: Component | None = None):
        super().__init__(spec, device)
        self.component = load_component(spec, device) if component is None else component
        name, c = spec.plan.name, self.component
        wrong = {p: t for p, t in spec.inputs.items() if t not in c.inputs.get(p, ())}
        missing = c.required - set(spec.inputs)
        extra = set(spec.outputs) - c.outputs
        if wrong or missing or extra:
            takes = "; ".join(f"{p}: {'|'.join(t)}" for p, t in c.inputs.items())
            raise ARBackendError(
                f"stage '{name}': {type(c).__name__} takes inputs ({takes}) with "
                f"{', '.join(sorted(c.required))} required, and outputs {', '.join(sorted(c.outputs))}; "
                f"the plan gives inputs {dict(spec.inputs)} and outputs {sorted(spec.outputs)}"
            )
        from transformers.cache_utils import DynamicLayer

        # Rows are joined, cut and masked column by column, which needs every layer to keep
        # every position (no sliding window, no recurrent state).
        other = {
            type(layer).__name__
            for layer in c.new_cache().layers
            if type(layer) is not DynamicLayer
        }
        if other:
            raise ARBackendError(
                f"stage '{name}': {spec.plan.model} has {', '.join(sorted(other))} cache layers; "
                "this backend batches full-attention layers only"
            )
        self.defaults = neutral_defaults() | c.defaults
        self.capacity = max(1, spec.plan.batch)
        # Seconds of audio a step plays for, where its steps become audio (slack order).
        self.plays_s = next(iter(spec.plays.values()), None)
        self.rows: list[Sequence] = []
        self.cache = None  # one row per entry of self.rows
        self.mask: torch.Tensor | None = None  # [rows, columns]: a row's own cache columns
        self.decode, self.static = self._static_decoder()
        # The static steps launched and not settled yet, oldest first (at most IN_FLIGHT),
        # and the prefills' first tokens (any number), each settled in the order queued.
        self.launches: deque[_Launch] = deque()
        self.firsts: deque[_Launch] = deque()
        self.queued = 0  # static launches and first tokens queued (their `order`)
        if self.static is not None:
            self.captures = self.static.captures
            self.capture_seconds = self.static.capture_seconds
            if self.captures:
                self.capture_work = self.static.capture_work().line()
        if torch.device(device).type == "cuda" and self.static is None:
            self._compile_first_token_sampler()

    def _compile_first_token_sampler(self) -> None:
        """Run the eager sampler the dynamic path's tokens take, with and without seen masks,
        so that Triton compiles those variants at load and not in a first request (the
        static path samples with its step's)."""
        logits = torch.zeros(1, self.component.head.out_features, device=self.device)
        for seen in (None, torch.zeros_like(logits, dtype=torch.bool)):
            sample(logits, temperature=1.0, repetition_penalty=1.05, seen=seen)

    def _static_decoder(self) -> tuple[str, static_decode.StaticDecoder | None]:
        """The decode mode ("eager", "static" or "graphs") and, unless eager, the static
        cache (graphs captured for "graphs"). "auto" is "graphs" on CUDA where the model
        supports it, else "eager"."""
        plan, c = self.spec.plan, self.component
        mode = plan.settings["decode"]
        cuda = torch.device(self.device).type == "cuda"
        why = static_decode.unsupported(c.decoder)
        if why is None and c.frame_spec is not None:
            why = static_decode.unsupported(c.frame_spec.predictor)
            why = why and f"its frames' second decoder: {why}"
        own_inputs = type(c).step_embeds is not Component.step_embeds
        if why is None and own_inputs and c.frame_spec is None:
            why = f"{type(c).__name__} builds its own step inputs"
        if why is None and type(c).mask_logits is not Component.mask_logits:
            why = f"{type(c).__name__} masks its logits per request"
        if mode == "auto":
            mode = "graphs" if cuda and why is None else "eager"
        if mode == "eager":
            return mode, None
        if why is not None:
            raise ARBackendError(f"stage '{plan.name}': decode='{mode}' cannot run: {why}")
        if mode == "graphs" and not cuda:
            raise ARBackendError(
                f"stage '{plan.name}': decode='graphs' needs a CUDA device, not {self.device}"
            )
        decoder = static_decode.StaticDecoder(
            c,
            slots=self.capacity,
            columns=cache_columns(plan, static_decode.kv_bytes_per_token(c.decoder)),
            device=self.device,
            capture=mode == "graphs",
            extra=type(c).step_extra is not Component.step_extra,
            frames=c.frame_spec,
        )
        return mode, decoder

    # --- the contract ---------------------------------------------------------------------------
    def ready(self, call: Call) -> bool:
        if call.error is not None:
            return False
        if call.finished or self.component.has_news(call):
            return True
        seq = call.state.get(_STATE)
        if seq is None:
            return self.component.can_start(call) and len(self.rows) < self.capacity
        if self.static is None:
            return self._may_step(seq) and not self._waits(seq)
        # On the static path a step makes progress if it can read landed tokens (a step's
        # or a prefill's first) or launch another; a row whose tokens are still on their way
        # waits without blocking.
        landed = bool(self.launches) and self.launches[0].launched.landed()
        launchable = len(self.launches) < IN_FLIGHT or landed
        landed = landed or bool(self.firsts) and self.firsts[0].launched.landed()
        waiting = seq.ahead > 0 or seq.first_ahead
        return waiting and landed or self._may_step(seq) and launchable and not self._waits(seq)

    def first_packet_in_flight(self) -> bool:
        return any(seq.slot >= 0 for first in self.firsts for seq in first.seqs)

    def in_flight(self) -> bool:
        # A step launched after its rows' end was learned waits, harmless, for the next
        # step to settle it: only a live row's tokens keep the loop polling.
        queued = [*self.firsts, *self.launches]
        live = any(seq.slot >= 0 for launch in queued for seq in launch.seqs)
        return live or self.component.in_flight()

    def urgent_first(self, calls: list[Call]) -> list[Call]:
        """Slack first where steps become audio: requests waiting to start (in arrival
        order), then the streams whose listeners run dry first."""
        if self.plays_s is None:
            return calls

        def runs_out(call: Call) -> float:
            seq = call.state.get(_STATE)
            return -math.inf if seq is None else seq.playback.runs_out(self.plays_s)

        return urgent_first(calls, runs_out)

    def _may_step(self, seq: Sequence) -> bool:
        return seq.next_step < seq.sampling.max_tokens and self.component.can_step(seq)

    def _waits(self, seq: Sequence) -> bool:
        """Whether the row's next step waits for work on the device (slack.py): its own
        request's window that a later stage holds its makers for, where every row is held;
        or a first packet, where the row's own first frame is on its way or its listener
        can wait."""
        held = self.held_requests
        # Held only where no other row steps: a step that runs anyway costs no more with
        # this row in it (its weights are read for the others).
        if seq.call.request_id in held and all(r.call.request_id in held for r in self.rows):
            return True
        if not self.first_packets_first or self.plays_s is None:
            return False
        return seq.first_ahead or can_wait(seq.playback.runs_out(self.plays_s), time.monotonic())

    @torch.inference_mode()
    def step(self, calls: list[Call]) -> None:
        starting, stepping = [], []
        self.component.receive(calls)
        for call in calls:
            seq = call.state.get(_STATE)
            if call.error is not None or call.finished:
                continue
            if seq is None:
                if (
                    self.component.can_start(call)
                    and len(self.rows) + len(starting) < self.capacity
                ):
                    starting.append(call)
            elif self._may_step(seq) and not self._waits(seq):
                stepping.append(seq)
        if self.static is None:
            if stepping:
                self._decode(stepping)
            if starting:  # after the decode step, so new rows get no dummy column
                self._prefill(starting)
            return
        # The static path queues new prompts' prefills ahead of the running rows' next step:
        # a new request's first frame waits for one step in flight fewer, and the running
        # rows' step moves one prefill later, once (the next turn's step did before).
        if starting:
            self._prefill(starting)
        self._launch_and_settle(stepping)

    def drop(self, call: Call) -> None:
        seq = call.state.pop(_STATE, None)
        if seq is not None and any(s is seq for s in self.rows):
            self._evict([seq])

    def close(self) -> None:
        self.rows, self.cache, self.mask = [], None, None
        self.launches, self.firsts = deque(), deque()
        if self.static is not None:
            self.static.close()
            self.static = None
        del self.component
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()

    # --- prefill and decode -----------------------------------------------------------------------
    def _forward(self, embeds, mask, positions, cache, **extra) -> torch.Tensor:
        out = self.component.decoder(
            inputs_embeds=self.component.project(embeds),
            attention_mask=mask.long(),
            position_ids=positions,
            cache=cache,
            use_cache=True,
            **extra,
        )
        return out.last_hidden_state

    def _no_room(self, length: int, max_tokens: int) -> str:
        """Why a prompt of `length` positions and `max_tokens` do not fit a slot's columns,
        naming the request's field that sets this stage's max_tokens (the pipeline's
        parameter: a talker's is `max_audio_tokens`) and what it could be instead."""
        field = self.spec.plan.params.get("max_tokens")
        field = field.name if isinstance(field, Param) else "max_tokens"
        columns = self.static.columns
        room = columns - length + 1
        fits = f"ask for at most {field}={room}" if room > 0 else "this prompt alone fills them"
        return (
            f"a prompt of {length} positions and {field}={max_tokens} need {length + max_tokens - 1}"
            f" cache columns; stage '{self.spec.plan.name}' has {columns} per request: {fits}"
        )

    def _start(self, call: Call, prompt: Prompt | OmniflowError) -> tuple[Sequence, Prompt] | None:
        """A starting request's sequence and its prompt (`component.prompts`'); None (the
        request failed) if its parameters or inputs cannot run."""
        component = self.component
        try:
            sampling = Sampling.of(call.params or {}, self.defaults, ARBackendError)
            if sampling.stop_strings and component.tokenizer is None:
                raise ARBackendError("stop strings need a tokenizer, and this model has none")
            if isinstance(prompt, OmniflowError):
                raise prompt
            length = prompt.embeds.shape[0]
            if self.static and length + sampling.max_tokens - 1 > self.static.columns:
                raise ARBackendError(self._no_room(length, sampling.max_tokens))
        except OmniflowError as err:
            call.fail(err)
            return None
        vocab = component.head.out_features
        seen = None
        if sampling.repetition_penalty != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            # (its ids sent without waiting: a list as an index is a pageable copy to the
            # device; index_fill_ takes the value as a kernel argument)
            seen.index_fill_(0, upload(prompt.context, self.device, torch.int64), True)
        generator = None
        seed = (
            sampling.seed
            if sampling.seed is not None
            else int.from_bytes(os.urandom(8), "little") >> 1
        )
        if sampling.temperature > 0:
            generator = torch.Generator(self.device).manual_seed(seed)
        text = None
        if component.tokenizer is not None and (
            "text" in self.spec.outputs or sampling.stop_strings
        ):
            text = TextStream(component.tokenizer, sampling.stop_strings)
        seq = Sequence(
            call,
            sampling,
            generator,
            seen,
            text,
            length,
            position_offset=prompt.position_offset,
            prompt_tokens=length,
            media=component.media_counts(prompt.context),
            seed=seed,
        )
        call.state[_STATE] = seq
        if "codes" in self.spec.outputs and (ahead := component.ahead_codes(seq)) is not None:
            call.emit("codes", ahead, ahead=True)  # now: the next stage may use the prefill's time
        return seq, prompt

    def _prefill(self, calls: list[Call]) -> None:
        """Prefill the starting requests in as few forwards as `prefill_tokens` allows."""
        prompts = self.component.prompts(calls)
        started = [s for s in map(self._start, calls, prompts) if s is not None]
        budget = self.spec.plan.settings["prefill_tokens"]
        lengths = [prompt.embeds.shape[0] for _, prompt in started]
        for group in prefill_groups(lengths, budget):
            self._prefill_group([started[i] for i in group])

    def _prefill_group(self, started: list[tuple[Sequence, Prompt]]) -> None:
        """One causal forward over the prompts, right-padded to the longest; then each
        request samples its first token and joins the running rows (on the static path,
        joins its slot and then the batch's first tokens are sampled on the device, in one
        `StaticDecoder.first`, emitted once they land: `_settle_firsts`). On the fused
        static path (nothing but embeddings and positions, multimodal ones where its rotary
        takes them) the forward writes the slots itself; else it is the model's forward into
        a DynamicCache, whose rows then join."""
        seqs = [seq for seq, _ in started]
        width = max(seq.length for seq in seqs)
        embeds = torch.stack([F.pad(p.embeds, (0, 0, 0, width - s.length)) for s, p in started])
        positions = None
        if any(p.positions is not None for _, p in started):
            rows = [_padded_positions(p, s.length, width, self.device) for s, p in started]
            if len({row.dim() for row in rows}) > 1:  # text prompts beside 3-D (mRoPE) ones
                like = next(row for row in rows if row.dim() == 3)
                rows = [row if row.dim() == 3 else row.expand(3, 1, -1).to(like) for row in rows]
            positions = torch.cat(rows, dim=-2)
        extra = self.component.prefill_inputs([p for _, p in started], width)
        direct = self.static is not None and self.static.fused and not extra
        direct = direct and (positions is None or self.static.takes_positions)
        if direct:
            first = len(self.rows)
            hidden = self.static.prefill(list(range(first, first + len(seqs))), embeds, positions)
        else:
            if positions is None:
                positions = torch.arange(width, device=self.device).repeat(len(seqs), 1)
            cache = self.component.new_cache()
            mask = torch.ones(len(seqs), width, dtype=torch.bool, device=self.device)
            hidden = self._forward(embeds, mask, positions, cache, **extra)
        values = [None] * len(seqs)
        if "hidden" in self.spec.outputs:
            values = [
                self.component.prompt_value(hidden[i, : s.length], p)
                for i, (s, p) in enumerate(started)
            ]
        ends = upload([s.length - 1 for s in seqs], hidden.device)
        last = hidden[torch.arange(len(seqs), device=hidden.device), ends]
        # (taken before any joins: the first row to join the dynamic path's empty batch takes
        # over the prefill's cache object)
        rows = [None if direct else _row_states(cache, i, s.length) for i, s in enumerate(seqs)]
        if self.static is None:
            self._advance(seqs, last, values)
            for seq, states in zip(seqs, rows, strict=True):
                if not seq.call.finished:
                    self._join(seq, states, cache)
            return
        # Each joins its slot (the one it was prefilled into, if direct), then the static
        # step's sampler gives the first tokens (and frames), queued like a step's: emitted
        # when they land (now, if they have), a finished one leaving again then.
        start = len(self.rows)
        self._join_static(seqs, rows)
        launched = self.static.first(start, last)
        slots = [seq.slot for seq in seqs]
        self.firsts.append(_Launch(seqs, slots, launched, None, self._order(), values))
        self._settle_firsts()

    def _decode(self, seqs: list[Sequence]) -> None:
        """One forward over every row; the rows of `seqs` advance, the others idle."""
        where = {id(s): i for i, s in enumerate(self.rows)}
        active = torch.tensor([where[id(s)] for s in seqs], device=self.device)
        inputs = self.component.step_embeds(seqs)
        embeds = inputs.new_zeros(len(self.rows), 1, inputs.shape[-1])
        embeds[active, 0] = inputs
        column = torch.zeros(len(self.rows), 1, dtype=torch.bool, device=self.device)
        column[active] = True
        mask = torch.cat([self.mask, column], dim=1)
        positions = torch.tensor(
            [[s.length + s.position_offset] for s in self.rows], device=self.device
        )
        hidden = self._forward(embeds, mask, positions, self.cache)[active, 0]
        self.mask = mask
        values = [None] * len(seqs)
        if "hidden" in self.spec.outputs:
            rows = self.component.hidden_rows(hidden, inputs)
            values = [rows[i : i + 1] for i in range(len(seqs))]
        for seq in seqs:
            seq.length += 1
        self._advance(seqs, hidden, values)
        self._evict([s for s in seqs if s.call.finished])

    def _launch(self, seqs: list[Sequence]) -> _Launch:
        """Queue one step of the static decoder over every row (a graph replay on
        "graphs"), in which the rows of `seqs` advance; `_settle` emits its tokens."""
        slots = [s.slot for s in seqs]
        launched = self.static.launch(
            len(self.rows),
            slots,
            max(s.length + s.ahead for s in seqs),
            self.component.step_extra(seqs) if self.static.has_extra else None,
        )
        hidden = None
        if "hidden" in self.spec.outputs:  # copied now: the next step overwrites the buffers
            hidden = self.component.hidden_rows(*self.static.outputs(slots))
        for seq in seqs:
            seq.ahead += 1
        return _Launch(seqs, slots, launched, hidden, self._order())

    def _order(self) -> int:
        self.queued += 1
        return self.queued

    def _launch_and_settle(self, stepping: list[Sequence]) -> None:
        """The static path's step, which never waits for the device: settle landed steps
        until there is room to launch, launch one over `stepping` (those still stepping),
        then settle the older steps that have landed. The step launched last stays in
        flight, so the host handles its predecessor's tokens while the device runs it; a
        step not landed yet is left for a later turn of the loop (`ready` says when)."""
        self._settle_firsts()
        while len(self.launches) >= IN_FLIGHT and self.launches[0].launched.landed():
            self._settle(self.launches.popleft())
        stepping = [s for s in stepping if s.slot >= 0 and self._may_step(s)]
        launched = None
        if stepping and len(self.launches) < IN_FLIGHT:
            launched = self._launch(stepping)
        while self.launches and self.launches[0].launched.landed():
            self._settle(self.launches.popleft())
        if launched is not None:
            self.launches.append(launched)

    def _settle(self, launch: _Launch) -> None:
        """Emit the tokens of a landed step (its ids are the only read-back), and evict the
        rows that finished. First tokens queued before it are emitted first (they have
        landed: the device ran them before it)."""
        self._settle_firsts(before=launch.order)
        self._emit_read_back(launch)

    def _settle_firsts(self, before: int | None = None) -> None:
        """Emit the first tokens (and frames) of the prefills whose tokens have landed,
        oldest first, or of all those queued `before` a step's order (landed, as that step
        has), and evict the requests that finished with them."""

        def due(first: _Launch) -> bool:
            return first.order < before if before is not None else first.launched.landed()

        while self.firsts and due(self.firsts[0]):
            self._emit_read_back(self.firsts.popleft())

    def _emit_read_back(self, launch: _Launch) -> None:
        """Emit a landed read-back's tokens (and codes), a step's or, with `values`, a
        prefill's first tokens, and evict the rows that finished. A row launched after its
        end (its end was learned while the read-back was queued), dropped or failed since
        gets nothing."""
        firsts = launch.values is not None
        ids, codes = self.static.wait(launch.launched)
        for i, (seq, slot) in enumerate(zip(launch.seqs, launch.slots, strict=True)):
            if firsts:
                seq.first_ahead = False
            else:
                seq.ahead -= 1
            if seq.slot < 0 or seq.call.finished or seq.call.error is not None:
                continue
            code = self._code(ids[slot], codes, slot)
            if firsts:
                value = launch.values[i]
            else:
                seq.length += 1
                value = None if launch.hidden is None else launch.hidden[i : i + 1]
            self._emit(seq, ids[slot], value, code)
        self._evict([s for s in launch.seqs if s.call.finished and s.slot >= 0])

    def _code(self, token: int, frames: torch.Tensor | None, slot: int) -> torch.Tensor | None:
        """The `codes` output of a static step's token (None: none): its frame, completed on
        the device (`frames`: the step's codes `[rows, G]`; an end id has none), else the
        component's `code`."""
        if "codes" not in self.spec.outputs:
            return None
        if frames is None:
            return self.component.code(token)
        return None if token in self.component.eos_ids else frames[slot : slot + 1].clone()

    def _advance(self, seqs: list[Sequence], hidden: torch.Tensor, values: list) -> None:
        """Sample each sequence's next token from its last hidden state, and emit it (the
        dynamic path)."""
        c = self.component
        logits = c.logits(hidden)
        if c.suppress:
            logits[:, list(c.suppress)] = -float("inf")
        early = [i for i, s in enumerate(seqs) if s.generated < c.min_tokens]
        if early and c.eos_ids:  # the end ids wait for the minimum length
            rows, ends = (torch.tensor(x, device=logits.device) for x in (early, sorted(c.eos_ids)))
            logits[rows[:, None], ends] = -float("inf")
        c.mask_logits(seqs, logits)
        if logits.is_cuda:
            ids = _sample_on_device(logits, seqs)
        else:
            ids = _sample_row_by_row(logits, seqs)
        codes = [None] * len(seqs)
        if "codes" in self.spec.outputs:
            codes = c.frames(seqs, ids, hidden)
        for seq, token, value, code in zip(seqs, ids, values, codes, strict=True):
            self._emit(seq, token, value, code)

    def _emit(self, seq: Sequence, token: int, value, code: torch.Tensor | None = None) -> None:
        """Emit a sampled token and its outputs (`code`: its `codes` value, if any)."""
        call, sampling, outputs = seq.call, seq.sampling, self.spec.outputs
        seq.generated += 1
        seq.last = token
        if seq.seen is not None:
            seq.seen[token] = True
        if "tokens" in outputs:
            call.emit("tokens", torch.tensor([[token]]))
        if code is not None:
            call.emit("codes", code)
        if self.plays_s is not None:  # one step, one frame (a clone's reference frames: silent)
            seq.playback.send(1, time.monotonic())
        if value is not None:
            call.emit("hidden", value)
        stopped = token in self.component.eos_ids or token in sampling.stop_ids
        if seq.text is not None:
            piece = "" if stopped else seq.text.add(token)
            stopped = stopped or seq.text.stopped
            if stopped or seq.generated >= sampling.max_tokens:
                piece += seq.text.close()
            if piece and "text" in outputs:
                call.emit("text", piece)
        if stopped or seq.generated >= sampling.max_tokens:
            reason = "stop" if stopped else "length"
            call.finish(Ending(reason, seq.prompt_tokens, seq.generated, seq.media))

    # --- the batched cache -------------------------------------------------------------------------
    def _join(self, seq: Sequence, states: list[tuple[torch.Tensor, torch.Tensor]], cache) -> None:
        """Add a prefilled request's row (`states`: its keys and values per layer, of its
        prefill's `cache`) to the batched cache."""
        self.rows.append(seq)
        own = torch.ones(1, seq.length, dtype=torch.bool, device=self.device)
        if self.cache is None:  # the prefill's cache object becomes the batch's, one row
            for layer, (keys, values) in zip(_filled(cache), states, strict=True):
                layer.keys, layer.values = keys, values
            self.cache, self.mask = cache, own
            return
        width = max(self.mask.shape[1], seq.length)
        for mine, (keys, values) in zip(_filled(self.cache), states, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(keys, width)])
            mine.values = torch.cat([_left_pad(mine.values, width), _left_pad(values, width)])
        self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(own, width)])

    def _join_static(self, seqs: list[Sequence], rows: list) -> None:
        """Put prefilled requests in the next free slots (their rows), before their first
        tokens, copying each one's keys and values (`rows[i]`: per layer) there unless
        their prefill wrote them into those slots (`rows[i]` None)."""
        start = len(self.rows)
        self.rows.extend(seqs)
        kv = [
            None
            if states is None
            else (torch.stack([k[0] for k, _ in states]), torch.stack([v[0] for _, v in states]))
            for states in rows
        ]
        states = []
        for slot, seq in enumerate(seqs, start=start):
            sampling = seq.sampling
            seq.slot, seq.first_ahead = slot, True
            states.append({
                "length": seq.length,
                "offset": seq.position_offset,
                "temperature": sampling.temperature if seq.generator is not None else 0.0,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "repetition_penalty": sampling.repetition_penalty,
                "seed": seq.seed,
                "seen": seq.seen,
                "min_tokens": self.component.min_tokens,
            })  # fmt: skip
            seq.seen = None  # from here on, the slot's seen mask (updated by the step)
        self.static.join(start, states, kv)

    def _evict(self, gone: list[Sequence]) -> None:
        if not gone:
            return
        if self.static is not None:
            for seq in gone:  # the last row moves into each hole: rows stay compact
                last = self.rows[-1]
                if last is not seq:  # with the columns of its steps still queued
                    self.static.move(last.slot, seq.slot, last.length + last.ahead)
                    last.slot = seq.slot
                    self.rows[seq.slot] = last
                else:
                    self.static.free(seq.slot)
                self.rows.pop()
                seq.slot = -1
            return
        keep = [i for i, s in enumerate(self.rows) if all(s is not g for g in gone)]
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = self.mask = None
            return
        rows = torch.tensor(keep, device=self.device)
        mask = self.mask.index_select(0, rows)
        columns = mask.any(dim=0).nonzero().squeeze(1)
        self.mask = mask.index_select(1, columns)
        for layer in _filled(self.cache):
            layer.keys = layer.keys.index_select(0, rows).index_select(2, columns)
            layer.values = layer.values.index_select(0, rows).index_select(2, columns)


def cache_columns(plan, bytes_per_token: int) -> int:
    """Columns (positions) of the static cache per request: what one request may fill (the
    plan's `cache_positions`, its cost's), rounded up to the length quantum; fewer where the
    stage's budget, less its weights and activations, cannot hold that for `max_batch`
    requests (no fewer than one quantum)."""
    quantum = static_decode.COLUMN_QUANTUM
    columns = -(-plan.cache_positions // quantum) * quantum
    room = plan.budget_bytes - plan.weight_bytes - plan.activation_bytes
    if plan.budget_bytes > 0:
        fits = room // (max(1, plan.batch) * bytes_per_token) // quantum * quantum
        columns = max(quantum, min(columns, fits))
    return columns


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """The prompts (by index, in order) each prefill forward takes: consecutive prompts while
    their count times the longest stays within `budget` padded positions; a prompt longer
    than the budget alone."""
    groups: list[list[int]] = []
    width = 0
    for i, length in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(width, length) <= budget:
            groups[-1].append(i)
            width = max(width, length)
        else:
            groups.append([i])
            width = length
    return groups


def _padded_positions(prompt: Prompt, length: int, width: int, device: str) -> torch.Tensor:
    """The prompt's position ids (`[1, width]` or `[3, 1, width]`), the padding after its
    `length` positions continuing them (a pad's position changes only the pad)."""
    if prompt.positions is None:
        return torch.arange(width, device=device)[None]
    positions = prompt.positions
    more = torch.arange(1, width - length + 1, device=positions.device)
    return torch.cat([positions, positions[..., -1:] + more], dim=-1)


def _row_states(cache, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values `[1, heads, length, d]` of one row of a prefill's cache, per layer."""
    return [
        (layer.keys[row : row + 1, :, :length], layer.values[row : row + 1, :, :length])
        for layer in _filled(cache)
    ]


def _filled(cache) -> list:
    """The cache layers that hold states: some transformers versions size a composite model's
    cache by another part's layer count, and the layers no forward reaches stay empty."""
    return [layer for layer in cache.layers if layer.keys is not None]


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Pad the sequence dim (dim 1 of a [B, T] mask, dim 2 of [B, heads, T, d] states) on the left."""
    missing = width - (t.shape[1] if t.dim() == 2 else t.shape[2])
    if missing == 0:
        return t
    return F.pad(t, (missing, 0) if t.dim() == 2 else (0, 0, missing, 0))

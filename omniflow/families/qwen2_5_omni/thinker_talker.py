"""Qwen2.5-Omni split into stages: the thinker and the talker as components of the
transformers `ar` backend, and the named adapters of the edges between the stages.

It reproduces what `Qwen2_5OmniForConditionalGeneration.generate` does, with streamed
inputs. There, the talker's input embeddings are built from the thinker's run:

- one row per thinker prompt position: the thinker's last hidden state there plus that
  position's input embedding, zero at an audio, image or video position (`generate`
  zeroes those rows; the thinker's `prompt_value` sends them zeroed);
- then the embedding of the speaker's text-side bos token (a thinker token);
- then the first reply row, where reply row i is the thinker's last hidden state at
  generated token i's position plus that token's embedding;
- and decode step t adds the embedding of the codec token sampled last to reply row t,
  then to the text eos embedding, then to the text pad embedding for ever.

The talker's forward would add the codec pad and bos embeddings to the last two prefill
rows, and compute its positions with its own `get_rope_index` (3-D on a prompt with
media: the grids, `use_audio_in_video`, audio lengths, seconds per grid), but only when it
is given an attention mask, and transformers 5's `generate` drops an all-ones mask: a
request alone (no padding) gets neither, and its talker's positions are 0 .. L-1 (the
talker model's default), media or not. That is what `generate` does here, so it is what
the talker stage does.

The last generated token is never fed back, so the thinker gives a row for every generated
token but its last. So the talker's step t needs exactly the thinker's row for generated
token t — it starts when the first reply row exists and keeps one row behind the thinker.

What travels on `thinker.hidden -> talker.embeds` is one item per thinker input position,
`[3, H]` in the thinker's dtype: its last hidden state, its input embedding, and a role row
(all 0 for a prompt position, all 1 for a generated token). The prompt's positions come in
the prefill step, then one per decode step. The role says where the prompt ends: the talker
puts the speaker row there, and an item's role is exact in every float dtype. The adapter
`thinker_to_talker` sums hidden state and embedding, so the talker reads `[2, H]` rows
(conditioning, role).

The talker's codec ids come out on `codes` as sampled, its end-of-speech id last; the
adapter `talker_to_code2wav` keeps the codes token2wav can embed and drops control ids.

Adapters are factories: the runtime calls `adapter(source)` with the `StagePlan` of the
stage the edge leaves, once when it links the plan, and applies the function it returns to
each chunk on the edge. Both work row by row, so chunking does not change their output.

Loading: `Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained` (or the talker's)
on the full checkpoint directory materializes only that part's tensors (the others are
reported unexpected and skipped), bit-equal to the same part of the full model, so a stage
holds one part's weights: the thinker with its audio and vision towers (unused on text
prompts), or the talker alone. The talker also needs a few rows of the thinker's embedding
table (speaker bos tokens, text eos and pad), read alone from the safetensors file, and the
speaker bos ids from `spk_dict.pt`.
"""

from __future__ import annotations

import inspect
import json
import re
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omniflow.backends.role_rows import RoleRows
from omniflow.backends.transformers_ar import (
    ARBackendError,
    CausalLM,
    Component,
    Prompt,
    Sequence,
)
from omniflow.backends.vision import MEDIA_HEADER_COLUMNS, check_media, unpack_media
from omniflow.plan import StagePlan
from omniflow.runtime.readback import Awaited, to_host, upload
from omniflow.runtime.stage import Call

ROLE_PROMPT, ROLE_REPLY = 0.0, 1.0
_US = 1_000_000  # a video's seconds per grid travel in microseconds
THINKER_EMBEDDINGS = "thinker.model.embed_tokens.weight"
_CONDITIONING = "qwen_omni"  # a talker request's conditioning rows in call.state
_MEDIA = "qwen_omni:media"  # a thinker request's media values and their headers' copy


# --- adapters ---------------------------------------------------------------------------------


def thinker_to_talker(
    source: StagePlan,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Thinker items `[n, 3, H]` (hidden state, embedding, role) -> talker rows `[n, 2, H]`
    (hidden state + embedding, role), summed in the thinker's dtype as `generate` does."""
    return _talker_rows


def _talker_rows(items: torch.Tensor) -> torch.Tensor:
    return torch.stack((items[:, 0] + items[:, 1], items[:, 2]), dim=1)


def talker_to_code2wav(
    source: StagePlan,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Talker codec ids `[n, Q]` -> the frames whose ids token2wav embeds (end-of-speech and
    other control ids dropped). The codebook size comes from the model catalog, which knows
    real checkpoints without fetching them."""
    from omniflow.catalog import load_component_config

    codes = load_component_config(source.model, "token2wav").config["dit_config"]["num_embeds"]

    def frames(ids: torch.Tensor) -> torch.Tensor:
        return ids[((ids >= 0) & (ids < codes)).all(dim=1)]

    return frames


# --- loading ----------------------------------------------------------------------------------


def speakers(path: str) -> tuple[str, ...] | None:
    """The speakers of the local checkpoint at `path` (`spk_dict.pt`: one entry each)."""
    file = Path(path) / "spk_dict.pt"
    return tuple(torch.load(file, weights_only=True)) if file.is_file() else None


def load(path: str, component: str | None, device: str, dtype) -> Component:
    """The thinker or the talker of the checkpoint at `path`, alone."""
    from transformers import AutoTokenizer

    parts = (
        "Qwen2_5OmniThinkerForConditionalGeneration",
        "Qwen2_5OmniTalkerForConditionalGeneration",
    )
    model = load_part(path, component, device, dtype, parts, "Qwen2.5-Omni", "token2wav")
    if component == "thinker":
        return OmniThinker(model, AutoTokenizer.from_pretrained(path))
    return OmniTalker(model, path)


def load_part(
    path: str,
    component: str | None,
    device: str,
    dtype,
    parts: tuple[str, str],
    model: str,
    vocoder: str,
    **options,
):
    """The thinker or the talker (`component`) of the omni checkpoint `model` at `path`,
    loaded alone by its transformers class (`parts`: the thinker's and the talker's;
    `options` go to `from_pretrained`) and checked whole; a thinker without its towers,
    which run on encoder stages (component "audio_tower", "visual"), as the `vocoder` runs
    on a vocoder stage. Each weight is read straight onto `device` (`device_map`), so that a
    checkpoint's conversions run there and the model needs no copy of the whole onto it
    afterwards: Qwen3-Omni's per-expert matrices are stacked into its fused expert tensors
    at load, which on the host took 4.6 s of the 8.4 s a thinker of 2 of its 48 layers took
    to load on a 2-core machine (the full-depth thinker: 55 s on an H100 host)."""
    import transformers

    classes = dict(zip(("thinker", "talker"), parts, strict=True))
    if component not in classes:
        raise ARBackendError(
            f"{model} has no '{component}' language model; use component=\"thinker\" or "
            f'"talker" ({vocoder} runs on a vocoder stage)'
        )
    part, info = getattr(transformers, classes[component]).from_pretrained(
        path,
        dtype=dtype,
        device_map={"": torch.device(device)},
        # transformers would swap layers for the Hub's kernels where `kernels` is installed
        # and a model loads onto a GPU: downloads at load (refused offline), other numerics
        # than the stage's own kernels and its tests
        use_kernels=False,
        output_loading_info=True,
        **options,
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ARBackendError(f"{path}: the {component} lacks weights {', '.join(missing[:5])}")
    if torch.device(device).type == "cuda":
        # transformers' loader threads copy on the default stream; the stage's stream must
        # not read the weights before those copies and the stacking after them are done.
        # Their allocations are in the default pool, not the stage's (runtime/load_pools.py):
        # the stacking's freed temporaries (~7 GiB for Qwen3-Omni's thinker and talker) would
        # stay reserved there, out of reach of the stages that load after this one
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    part = part.eval()
    if component == "thinker":
        del part.model.audio_tower, part.model.visual
    return part


def thinker_embedding_rows(path: str, ids: list[int]) -> torch.Tensor:
    """Rows `ids` of the thinker's input embedding table, read without loading the table."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(
        path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False
    )
    if index is None:
        filename = "model.safetensors"
    else:
        with open(index, encoding="utf-8") as f:
            filename = json.load(f)["weight_map"][THINKER_EMBEDDINGS]
    with safe_open(cached_file(path, filename), "pt") as f:
        table = f.get_slice(THINKER_EMBEDDINGS)
        return torch.cat([table[i : i + 1] for i in ids])


_WHOLE_MODEL = "Qwen2_5OmniForConditionalGeneration"


def generate_default(name: str, model: str = _WHOLE_MODEL):
    """A default of the `generate` of the transformers class `model`, an omni model whole
    (the talker's sampling, the speaker and, for some, the thinker's end of turn are set
    there, not in a generation config)."""
    import transformers

    return inspect.signature(getattr(transformers, model).generate).parameters[name].default


# --- the thinker -------------------------------------------------------------------------------


class MediaThinker(CausalLM):
    """A thinker: a causal LM on a chat and, optionally, its media's embeddings from the
    encoder stages (`embeds`: the vision tower's images and videos, `audio_embeds`: the audio
    tower's clips). What Qwen2.5-Omni's and Qwen3-Omni's thinkers share; a subclass gives
    its model's interleaving of a video with its audio track (`_interleaved`) and, where its
    vision items carry more than embeddings, how they join the prompt (`merge_media`).

    With media it does what the model's processor and the thinker's forward do: each
    placeholder of the chat template (the image, audio and video pad tokens, in the order
    the chat places them) becomes one token per embedding (with `use_audio_in_video`, a
    video's tokens and its audio track's — the next audio item — interleaved between the
    audio markers); the embeddings go in place of those tokens' (`masked_scatter` per kind);
    the prefill's positions are the model's own multimodal RoPE, `get_rope_index(ids,
    image_grid_thw, video_grid_thw, mask, use_audio_in_video, audio feature lengths,
    second_per_grids)`, and each decode step's the cache length plus its rope delta. Its
    prompt may be a text or token ids too, as a plain causal LM's (then without media)."""

    inputs = {**CausalLM.inputs, "embeds": ("hidden",), "audio_embeds": ("hidden",)}
    required = frozenset({"prompt"})
    prompt_positions = True

    def __init__(self, model, tokenizer, audio_markers: tuple[str, str]):
        super().__init__(model, tokenizer)
        self.headers = Awaited()  # requests' media headers on their way to the host
        config = model.config
        self.media_ids = {
            "image": config.image_token_id,
            "video": config.video_token_id,
            "audio": config.audio_token_id,
        }
        self.media_tokens = {
            kind: tokenizer.convert_ids_to_tokens(i) for kind, i in self.media_ids.items()
        }
        self.audio_bos, self.audio_eos = audio_markers
        self.position_id_per_seconds = config.position_id_per_seconds
        self.merge = config.vision_config.spatial_merge_size
        self.rope_index = model.model.get_rope_index

    def can_start(self, call: Call) -> bool:
        """Once every input is in and the media values' headers have come to the host: they
        are taken then and their header columns copied without waiting (`_MEDIA`), as
        reading them on the device would stall every stage of the process per item."""
        if not call.inputs_ended():
            return False

        def media() -> tuple:
            values = [
                check_media(value)
                for port in ("embeds", "audio_embeds")
                if port in call.inputs and (value := call.inputs[port].take()) is not None
            ]
            heads = to_host(*(v[0, :, :MEDIA_HEADER_COLUMNS] for v in values)) if values else None
            return values, heads

        return self.headers.landed(call, _MEDIA, media)

    def in_flight(self) -> bool:
        return self.headers.in_flight()

    def prompt(self, call: Call) -> Prompt:
        values, heads = self.headers.take(call, _MEDIA)
        host = () if heads is None else (heads.value, *heads.more)
        items = [item for v, h in zip(values, host, strict=True) for item in unpack_media(v, h)]
        if not items:
            return super().prompt(call)
        if call.inputs["prompt"].type != "chat":
            raise ARBackendError("media go with a chat prompt, whose parts place them")
        media = {kind: [i for i in items if i.kind == kind] for kind in self.media_ids}
        in_video = bool((call.params or {}).get("use_audio_in_video"))
        text = self.tokenizer.apply_chat_template(
            call.inputs["prompt"].take(), add_generation_prompt=True, tokenize=False
        )
        text = self._expand(text, media, in_video)
        host_ids = torch.tensor(self.tokenizer(text).input_ids)
        ids = upload(host_ids, self.embed.weight.device)  # (not waiting for queued steps)
        embeds, prefill = self.merge_media(ids, self.embed(ids), media)
        grid = {
            kind: torch.tensor([i.meta[1:4] for i in media[kind]]) if media[kind] else None
            for kind in ("image", "video")
        }
        audio_lengths = (
            torch.tensor([i.meta[1] for i in media["audio"]]) if media["audio"] else None
        )
        per_grid = (
            torch.tensor([i.meta[4] / _US for i in media["video"]]) if media["video"] else None
        )
        # On the host: the model's `get_rope_index` walks the prompt in Python, item by item,
        # and on a GPU each of its small ops would be a launch and many a read-back. Integer
        # positions: the same on either device.
        positions, delta = self.rope_index(
            host_ids[None],
            grid["image"],
            grid["video"],
            torch.ones_like(host_ids)[None],
            in_video,
            audio_lengths,
            per_grid,
        )
        positions = upload(positions, ids.device)
        return Prompt(embeds, host_ids.tolist(), positions, int(delta.reshape(-1)[0]), prefill)

    def merge_media(self, ids: torch.Tensor, embeds: torch.Tensor, media: dict):
        """The prompt's input embeddings with each kind's item rows in place of its
        placeholder tokens', and what else the prompt carries (`Prompt.prefill`): its media
        positions, `[L]` bool, which no forward reads (`prefill_inputs` gives none) but
        `prompt_value` does."""
        for kind, token in self.media_ids.items():
            if media[kind]:
                rows = torch.cat([i.embeds for i in media[kind]]).to(embeds.device, embeds.dtype)
                embeds = embeds.masked_scatter((ids == token)[:, None], rows)
        return embeds, self.placeholders(ids)

    def placeholders(self, ids: torch.Tensor) -> torch.Tensor:
        """Where `ids` `[L]` hold an image, video or audio placeholder: `[L]` bool."""
        kinds = torch.tensor(list(self.media_ids.values()), device=ids.device)
        return torch.isin(ids, kinds)

    def _expand(self, text: str, media: dict, in_video: bool) -> str:
        """The template's text with each placeholder expanded as the processor does."""
        tokens = {token: kind for kind, token in self.media_tokens.items()}
        pieces = re.split("(" + "|".join(map(re.escape, tokens)) + ")", text)
        taken = dict.fromkeys(self.media_ids, 0)
        out = []
        for piece in pieces:
            kind = tokens.get(piece)
            if kind is None:
                out.append(piece)
                continue
            if taken[kind] >= len(media[kind]):
                raise ARBackendError(
                    f"the chat has more {kind} parts than the request brings {kind}s "
                    f"({len(media[kind])})"
                )
            item = media[kind][taken[kind]]
            taken[kind] += 1
            if kind == "video" and in_video:
                if taken["audio"] >= len(media["audio"]):
                    raise ARBackendError(
                        "use_audio_in_video: a video has no audio track among the request's audio"
                    )
                audio = media["audio"][taken["audio"]]
                taken["audio"] += 1
                out.append(self._interleaved(item, audio))
            else:
                out.append(piece * item.meta[0])
        left = {k: len(media[k]) - taken[k] for k in media if len(media[k]) != taken[k]}
        if left:
            raise ARBackendError(
                "the request brings media its chat has no place for: "
                + ", ".join(f"{n} {k}(s)" for k, n in left.items())
            )
        return "".join(out)

    def hidden_rows(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """A decode step's items: each row's `hidden_value` as a reply position's."""
        return self.hidden_value(hidden, embeds, prompt=False)

    @abstractmethod
    def _interleaved(self, video, audio) -> str:
        """A video's placeholder text with its audio track's (`use_audio_in_video`), as the
        model's processor writes it."""


class OmniThinker(MediaThinker):
    """Qwen2.5-Omni's thinker (`MediaThinker`), whose `hidden` output is the talker's
    conditioning, one `[3, H]` item per position it feeds. With `use_audio_in_video` a
    video's frames and its audio track are interleaved in 2 s chunks, as
    `replace_video_with_audio_token` does."""

    def __init__(self, model, tokenizer):
        config = model.config
        markers = (config.audio_start_token_id, config.audio_end_token_id)
        super().__init__(model, tokenizer, tuple(tokenizer.convert_ids_to_tokens(markers)))
        self.seconds_per_chunk = config.seconds_per_chunk

    def _interleaved(self, video, audio) -> str:
        """`Qwen2_5OmniProcessor.replace_video_with_audio_token`: a video's tokens and its
        audio track's, in chunks of `seconds_per_chunk`, between audio bos and eos."""
        _, t, h, w, per_grid = video.meta
        per_second = self.position_id_per_seconds
        frames = torch.arange(t).repeat_interleave((h // self.merge) * (w // self.merge))
        video_index = (frames * (per_grid / _US) * per_second).tolist()
        per_chunk = int(per_second * self.seconds_per_chunk)
        video_chunks = _chunks(video_index, per_chunk)
        audio_chunks = _chunks(list(range(audio.meta[0])), per_chunk)
        out = self.audio_bos
        for j in range(max(len(video_chunks), len(audio_chunks))):
            if j < len(video_chunks):
                out += self.media_tokens["video"] * (video_chunks[j][1] - video_chunks[j][0])
            if j < len(audio_chunks):
                out += self.media_tokens["audio"] * (audio_chunks[j][1] - audio_chunks[j][0])
        return out + self.audio_eos

    def prompt_value(self, hidden: torch.Tensor, prompt: Prompt):
        """The prompt's items; on a media prompt each media position's input embedding is
        zero, as `generate` zeroes the audio, image and video rows of the embeddings it
        gives its talker (`masked_scatter` of zeros): the talker is conditioned on the
        thinker's hidden state alone there."""
        value = super().prompt_value(hidden, prompt)
        if prompt.prefill is not None:
            value[prompt.prefill, 1] = 0
        return value

    def hidden_value(self, hidden: torch.Tensor, embeds: torch.Tensor, prompt: bool):
        role = torch.full_like(hidden, ROLE_PROMPT if prompt else ROLE_REPLY)
        return torch.stack((hidden, embeds.to(hidden.dtype), role), dim=1)


def _chunks(index: list, per_chunk: int) -> list[tuple[int, int]]:
    """`Qwen2_5OmniProcessor.get_chunked_index`: (start, end) slices of `index` whose values
    fall in successive ranges of `per_chunk`."""
    out, start, chunk = [], 0, 1
    for i, value in enumerate(index):
        if value >= chunk * per_chunk:
            out.append((start, i))
            start = i
            chunk += 1
    out.append((start, len(index)))
    return out


# --- the talker ---------------------------------------------------------------------------------


@dataclass
class _Conditioning:
    """A talker request's text-side rows received so far (conditioning, on the device)."""

    prompt: list[torch.Tensor] = field(default_factory=list)  # chunks [k, H]
    replies: list[torch.Tensor] = field(default_factory=list)  # rows [H]


class ThinkerFedTalker(Component):
    """A talker fed its thinker's rows on `embeds`, each row's role (prompt or reply) read
    back without waiting (`RoleRows`, roles picked by `roles`): what Qwen2.5-Omni's and
    Qwen3-Omni's talkers share (and a talker model's parts). A subclass checks an arriving
    chunk and hands it to `self.conditioning` (`_arrive`); the base keeps a chunk whose roles
    have landed (`_take`), and the subclass may act on what the request has then
    (`_received`); a request that failed takes no more.
    A subclass names, too, what a chunk's rows are (`rows_name`, each `row_shape`, through
    `adapter`; kept as `row_dtype`, None: as they come), where a request keeps them:
    `call.state[state_key]`, a `state()` with lists `prompt` (chunks) and `replies` (rows),
    and which part of a row each keeps (`prompt_part`, `reply_part`: an index into a row's
    second dimension)."""

    rows_name: str
    adapter: str
    row_shape: tuple[int, int]
    row_dtype: torch.dtype | None = None
    state_key: str
    state: type
    prompt_part: int | slice
    reply_part: int

    inputs = {"embeds": ("hidden",)}
    required = frozenset({"embeds"})
    outputs = frozenset({"codes", "tokens", "hidden"})

    def __init__(self, model, roles: Callable[[torch.Tensor], torch.Tensor]):
        self.model = model
        self.decoder = model.model
        self.head = model.codec_head
        self.embed = model.get_input_embeddings()
        self.conditioning = RoleRows("embeds", roles)

    def has_news(self, call: Call) -> bool:
        return self.conditioning.available(call)

    def in_flight(self) -> bool:
        return self.conditioning.in_flight()

    def receive(self, calls: list[Call]) -> None:
        for call in calls:
            chunk = call.inputs["embeds"].take()
            if call.error is not None:
                continue
            if chunk is not None:
                self._arrive(call, chunk)
            # Taken to the end on a failure too: no chunk of it stays in flight.
            for rows, roles in self.conditioning.take(call):
                if call.error is None:
                    self._take(call, rows, roles)
            if call.error is None:
                self._received(call)

    def _arrive(self, call: Call, chunk: torch.Tensor) -> None:
        """Check a chunk of thinker rows and keep a copy while its roles come to the host."""
        if chunk.dim() != 3 or tuple(chunk.shape[1:]) != self.row_shape:
            rows, want = self.rows_name, ", ".join(map(str, self.row_shape))
            call.fail(
                ARBackendError(
                    f"the talker takes {rows} [n, {want}] from the thinker through adapter "
                    f"{self.adapter}; got {list(chunk.shape)}"
                )
            )
            return
        # A copy: the chunk may be a view into a channel slot released after the step.
        self.conditioning.arrive(
            call, upload(chunk, self.embed.weight.device, self.row_dtype, copy=True)
        )

    def _take(self, call: Call, chunk: torch.Tensor, roles: list[float]) -> None:
        """Keep a chunk of thinker rows whose `roles` have landed in the request's `state`:
        its prompt rows (`prompt_part` of each), then its replies' (`reply_part`). The
        prompt comes whole before the replies."""
        cond = call.state.setdefault(self.state_key, self.state())
        reply = [role == ROLE_REPLY for role in roles]
        start = reply.index(True) if True in reply else len(reply)
        if (cond.replies and start) or not all(reply[start:]):
            call.fail(ARBackendError("thinker prompt rows arrived after its reply rows"))
            return
        if start:
            cond.prompt.append(chunk[:start, self.prompt_part])
        cond.replies.extend(chunk[start:, self.reply_part].unbind())

    def _received(self, call: Call) -> None:
        """What the talker does with a request's rows once a turn's chunks are kept."""


class OmniTalker(ThinkerFedTalker):
    """The talker: codec tokens conditioned on the thinker's rows and a speaker (the stage's
    `speaker` parameter, else `generate`'s default)."""

    rows_name, adapter = "conditioning rows", "qwen_omni.thinker_to_talker"
    state_key, state = _CONDITIONING, _Conditioning
    prompt_part = reply_part = 0  # the conditioning row, not the role

    def __init__(self, model, path: str):
        # The thinker's rows, their roles (row 1) read back without waiting.
        super().__init__(model, lambda rows: rows[:, 1, 0])
        config = model.config
        self.width = config.embedding_size
        self.row_shape, self.row_dtype = (2, self.width), self.embed.weight.dtype
        self.eos_ids = frozenset({config.tts_codec_pad_token_id, config.tts_codec_end_token_id})
        self.suppress = (config.tts_codec_start_token_id,)
        # generate() feeds the talker ids [codec mask] * prompt length + [codec pad, codec bos]
        # beside the embeddings, and its repetition penalty counts them as seen.
        self.context = [
            config.tts_codec_mask_token_id,
            config.tts_codec_pad_token_id,
            config.tts_codec_start_token_id,
        ]
        self.defaults = talker_defaults()
        from transformers.utils import cached_file

        speakers = torch.load(cached_file(path, "spk_dict.pt"), weights_only=True)
        names = sorted(speakers)
        ids = [config.tts_text_end_token_id, config.tts_text_pad_token_id]
        ids += [int(speakers[n]["bos_token"]) for n in names]
        rows = thinker_embedding_rows(path, ids).to(
            self.embed.weight.device, self.embed.weight.dtype
        )
        self.text_eos, self.text_pad = rows[0], rows[1]
        self.speakers = dict(zip(names, rows[2:], strict=True))
        self.default_speaker = generate_default("speaker")

    def project(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.model.thinker_to_talker_proj(embeds)

    # --- conditioning -----------------------------------------------------------------------
    def can_start(self, call: Call) -> bool:
        cond = call.state.get(_CONDITIONING)
        return cond is not None and (bool(cond.replies) or self.conditioning.ended(call))

    def _text_side(self, cond: _Conditioning, t: int) -> torch.Tensor:
        """The thinker-side row of talker step t (call only once it is known)."""
        if t < len(cond.replies):
            return cond.replies[t]
        return self.text_eos if t == len(cond.replies) else self.text_pad

    def prompt(self, call: Call) -> Prompt:
        cond = call.state[_CONDITIONING]
        prompt = torch.cat(cond.prompt)
        if not len(prompt):
            raise ARBackendError("the thinker sent no prompt rows")
        speaker = (call.params or {}).get("speaker") or self.default_speaker
        if speaker not in self.speakers:
            raise ARBackendError(
                f"unknown speaker '{speaker}'; this model has {', '.join(self.speakers)}"
            )
        rows = torch.stack((self.speakers[speaker], self._text_side(cond, 0)))
        return Prompt(torch.cat((prompt, rows)), self.context)

    def can_step(self, seq: Sequence) -> bool:
        cond = seq.call.state[_CONDITIONING]
        return seq.next_step < len(cond.replies) or self.conditioning.ended(seq.call)

    def step_extra(self, seqs: list[Sequence]) -> torch.Tensor:
        """Step t's text side: the thinker's row for reply token t, then text eos, then pad."""
        return torch.stack(
            [self._text_side(s.call.state[_CONDITIONING], s.next_step) for s in seqs]
        )


def talker_defaults(model: str = _WHOLE_MODEL) -> dict:
    """The talker's sampling defaults, which `generate` of the whole `model` sets, not a
    generation config."""
    names = ("temperature", "top_p", "top_k", "repetition_penalty")
    defaults = {name: generate_default(f"talker_{name}", model) for name in names}
    if not generate_default("talker_do_sample", model):
        defaults["temperature"] = 0.0
    return defaults

"""Qwen3-Omni's thinker and talker as components of the transformers `ar` backend, and the
named adapters of the edges between the stages.

It reproduces what `Qwen3OmniMoeForConditionalGeneration.generate` does, with streamed
inputs. There the talker's input embeddings are built from the thinker's run:

- the user part: one row per prompt position in a user turn (a position whose last
  `<|im_start|>` is followed by `user`), the talker's `text_projection` of that position's
  thinker input embedding (at an audio/image/video placeholder, `hidden_projection` of the
  thinker's hidden state of layer `accept_hidden_layer`);
- the assistant part, from A = the `text_projection` of the thinker input embeddings from
  the last `<|im_start|>assistant` on (its 3 prompt positions, then the generated tokens):
  A0..A2 with no codec row, four tts pad rows plus the codec rows no-think, think bos,
  think eos and the speaker, tts bos plus codec pad, A3 (the first reply token) plus codec
  bos;
- decode step t feeds the sum of the 16 codebook embeddings of frame t (the talker's own
  for codebook 0, the code predictor's for the others) plus A[4 + t], then tts eos once the
  text is spent, then tts pad for ever. The last generated token is never fed back to the
  thinker, so A has no row for it (as in `generate`);
- on a prompt with media, the talker's positions are 3-D: its own `get_rope_index` over
  the user part's ids and the assistant part's, with the media's grids, seconds per grid
  and audio feature lengths (`Talker._positions`); else 0 .. L-1.

Each talker step samples codebook 0 of a frame from the codec head (the upper 1024 ids
suppressed but end of speech, repetition penalty over the codes it sampled); its 5-layer
code predictor then generates codebooks 1..15 from the talker's last hidden state and that
code, 15 steps of its own (the talker's `frame_spec`: on the dynamic path the backend's
`frames`, on the static one inside the decode step, `omniflow.backends.static_decode`,
its draws keyed as the backend's `sample_sub_step` keys them). The stage emits each frame
whole on `codes`, int64 `[1, 16]`, as it is sampled. `generate` runs the code predictor one step later (in
the step that feeds the frame back), so a talker stopped by `talker_max_new_tokens=N` makes
N - 1 frames there and N here; before the end of speech they agree frame for frame.

What travels on `thinker.hidden -> talker.embeds` is one item per thinker input position,
`[3, H]` in the thinker's dtype: the hidden state of layer `accept_hidden_layer`, the input
embedding, and a role row (all 0 for a prompt position, all 1 for a generated token). The
prompt's positions come in the prefill step, then one per decode step. `generate` finds
the user turns, the assistant's turn and the media placeholders in the input ids; the
talker finds them in the embeddings, which are those ids' rows of the thinker's table (it
reads the rows of `<|im_start|>`, `user`, `assistant`, the placeholders and the media's
start markers from the checkpoint), on the device, and segments the prompt on the host once
that finding has come back, never waiting for it (`Talker._find_markers`). At a media
position the item's embedding is the placeholder's row (the talker reads no embedding
there), and the role row of each media item's first position carries, after the role, the
item's kind and integers (its grid, seconds per grid, audio feature length:
`media_header`), which the talker's positions need. The adapter `thinker_to_talker` passes
the items as they are.

Loading: `Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained` (or the talker's) on
the full checkpoint directory materializes only that part's tensors, bit-equal to the same
part of the full model: the thinker (its audio and vision towers dropped: they run on
encoder stages, `towers`), or the talker with its code predictor. transformers 5.24 merges the checkpoint's
per-expert MoE weights into its fused expert tensors by `model_type`, for the whole model
and the thinker but not for the talker loaded alone, so `load` registers the same merge
for the talker's class first. On CUDA both load with their MoE experts on omniflow's fused
kernels (`omniflow.kernels.fused_moe`, registered as a transformers experts
implementation); elsewhere on transformers' own.

Static decode (decode="static", or "graphs", the default on CUDA): both decoders' layers are
sparse MoE blocks, which the static step runs on the fused MoE kernels with no host
readback (`fused_moe.routed`); the thinker's decoder is a `TappedDecoder` (its rows carry
the accept layer's state), and the talker's frame, its code predictor's 15 steps and their
draws, is completed inside its step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from omniflow.backends.checkpoint_files import CONFIG, read_json
from omniflow.backends.static_decode import FrameSpec
from omniflow.backends.tapped_decoder import TappedDecoder
from omniflow.backends.transformers_ar import (
    ARBackendError,
    Component,
    Prompt,
    Sequence,
    sub_sampling,
)
from omniflow.backends.vision import MEDIA_HEADER_COLUMNS, media_header, read_media_header
from omniflow.families.qwen2_5_omni.thinker_talker import (
    ROLE_PROMPT,
    ROLE_REPLY,
    MediaThinker,
    ThinkerFedTalker,
    generate_default,
    load_part,
    talker_defaults,
    thinker_embedding_rows,
)
from omniflow.families.qwen3_omni import AUDIO_TOKENS, CODEBOOK_OFFSETS
from omniflow.kernels import fused_moe
from omniflow.plan import StagePlan
from omniflow.runtime.readback import Awaited, HostCopy, to_host, upload
from omniflow.runtime.stage import Call

# `generate` suppresses the talker's top 1024 ids but the end of speech.
SUPPRESSED_SPECIALS = 1024
_STATE = "qwen3_omni"  # a talker request's conditioning in call.state
# The talker prompt's assistant part: 3 text rows, 4 tts pads, tts bos, the first reply.
_ASSISTANT_ROWS = 9


# --- adapters ---------------------------------------------------------------------------------


def thinker_to_talker(source: StagePlan) -> Callable[[torch.Tensor], torch.Tensor]:
    """Thinker items `[n, 3, H]` (accept-layer hidden state, input embedding, role) -> the
    talker's conditioning, the same items: the talker projects them itself."""
    return _items


def _items(items: torch.Tensor) -> torch.Tensor:
    return items


def talker_to_code2wav(source: StagePlan) -> Callable[[torch.Tensor], torch.Tensor]:
    """Talker frames `[n, 16]` -> the frames code2wav embeds (any with an id outside the
    codebook dropped). The codebook size comes from the model catalog, which knows real
    checkpoints without fetching them."""
    from omniflow.catalog import load_component_config

    codebook = load_component_config(source.model, "code2wav").config["codebook_size"]

    def frames(codes: torch.Tensor) -> torch.Tensor:
        return codes[((codes >= 0) & (codes < codebook)).all(dim=1)]

    return frames


# --- loading ----------------------------------------------------------------------------------


def load(path: str, component: str | None, device: str, dtype) -> Component:
    """The thinker or the talker of the checkpoint at `path`, alone."""
    from transformers import AutoTokenizer

    register_talker_expert_merge()
    # The fused kernels read the experts where transformers keeps them: no copy at load.
    experts = (
        {"experts_implementation": fused_moe.register()}
        if torch.device(device).type == "cuda"
        else {}
    )
    parts = (
        "Qwen3OmniMoeThinkerForConditionalGeneration",
        "Qwen3OmniMoeTalkerForConditionalGeneration",
    )
    model = load_part(path, component, device, dtype, parts, "Qwen3-Omni", "code2wav", **experts)
    layout = read_json(path, CONFIG) or {}
    if component == "thinker":
        return Thinker(model, AutoTokenizer.from_pretrained(path), layout)
    return Talker(model, path, layout)


@functools.cache
def register_talker_expert_merge() -> None:
    """Have transformers merge the talker's per-expert checkpoint weights into its fused
    expert tensors when the talker loads alone, as it does for the whole model (the merge of
    every Qwen2-MoE-style model, which it registers by `model_type` for the whole model and
    the thinker, and which the talker's config does not name)."""
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    name = "Qwen3OmniMoeTalkerForConditionalGeneration"
    if get_checkpoint_conversion_mapping(name) is None:
        register_checkpoint_conversion_mapping(name, get_checkpoint_conversion_mapping("qwen2_moe"))


_WHOLE_MODEL = "Qwen3OmniMoeForConditionalGeneration"


def _top_level(layout: dict, key: str):
    """A token id of the whole model's config (its class default where the file has none)."""
    if key in layout:
        return layout[key]
    from transformers import Qwen3OmniMoeConfig

    return getattr(Qwen3OmniMoeConfig, key)


# --- the thinker -------------------------------------------------------------------------------


@dataclass
class _Media:
    """What a media prompt carries beside its embeddings (`Prompt.prefill`): its token ids,
    each media item's first position, kind and integers (the talker's 3-D positions need
    them), and the deepstack features at its image and video positions, in order."""

    ids: torch.Tensor  # [L]
    starts: list[tuple[int, str, tuple[int, ...]]]
    visual: torch.Tensor  # [L] bool
    features: torch.Tensor | None  # [V, D * H]: V visual positions, D deepstack layers


class Thinker(MediaThinker):
    """The thinker: a causal LM (ending at `<|im_end|>`, as `generate` ends it) on a chat
    and, optionally, its media's embeddings from the encoder stages (`MediaThinker`: the
    processor's placeholders, the model's `get_rope_index`), whose `hidden` output is the
    talker's conditioning, one `[3, H]` item per position it feeds.

    Qwen3-Omni's own, beside Qwen2.5-Omni's: with `use_audio_in_video` a video's tokens and
    its audio track's are merged by time (each video grid at its start time, one position
    id per audio token), as `Qwen3OmniMoeProcessor.replace_video_with_audio_token` does; and
    each image or video item's rows carry the vision tower's deepstack features beside its
    embeddings (`towers`), which the prefill adds to the outputs of the first decoder
    layers at the image and video positions (the text model's `visual_pos_masks` and
    `deepstack_visual_embeds`, as the thinker's forward passes them). Decode steps have no
    visual positions: they take none."""

    def __init__(self, model, tokenizer, layout: dict):
        super().__init__(model, tokenizer, AUDIO_TOKENS)
        self.width = model.config.text_config.hidden_size
        self.deepstack = len(model.config.vision_config.deepstack_visual_indexes)
        layer = (layout.get("talker_config") or {}).get("accept_hidden_layer")
        if layer is None:
            from transformers import Qwen3OmniMoeTalkerConfig

            layer = Qwen3OmniMoeTalkerConfig().accept_hidden_layer
        self.decoder = TappedDecoder(self.decoder, layer)
        # generate() ends the thinker at `thinker_eos_token_id`: the model's <|im_end|>.
        self.eos_ids = frozenset({int(_top_level(layout, "im_end_token_id"))})

    def merge_media(self, ids: torch.Tensor, embeds: torch.Tensor, media: dict):
        visual = torch.zeros_like(ids, dtype=torch.bool)
        features, starts = None, []
        for kind, token in self.media_ids.items():
            if not media[kind]:
                continue
            rows = torch.cat([i.embeds for i in media[kind]]).to(embeds.device)
            at = ids == token
            where = at.nonzero().flatten().tolist()
            if len(where) != len(rows):
                raise ARBackendError(
                    f"the prompt has {len(where)} {kind} positions for {len(rows)} embeddings"
                )
            first = 0
            for item in media[kind]:
                starts.append((where[first], kind, item.meta))
                first += item.meta[0]
            if kind != "audio":
                wide = self.width * (1 + self.deepstack)
                if rows.shape[-1] != wide:
                    raise ARBackendError(
                        f"{kind} rows are {rows.shape[-1]} wide, not the vision tower's {wide} "
                        "(embeddings and deepstack features)"
                    )
                if features is None:
                    features = rows.new_zeros(len(ids), wide - self.width)
                features[at] = rows[:, self.width :]
                visual |= at
                rows = rows[:, : self.width]
            embeds = embeds.masked_scatter(at[:, None], rows.to(embeds.dtype))
        deep = None if features is None else features[visual]
        return embeds, _Media(ids, sorted(starts), visual, deep)

    def prefill_inputs(self, prompts: list[Prompt], width: int) -> dict:
        """The deepstack features of the prompts that have some: `visual_pos_masks` over
        the padded batch and, per deepstack layer, the features at those positions in the
        mask's order (row by row)."""
        stacks = [
            (i, p.prefill)
            for i, p in enumerate(prompts)
            if p.prefill is not None and p.prefill.features is not None
        ]
        if not stacks:
            return {}
        device = self.embed.weight.device
        visual = torch.zeros(len(prompts), width, dtype=torch.bool, device=device)
        for i, deep in stacks:
            visual[i, : len(deep.visual)] = deep.visual
        features = torch.cat([deep.features for _, deep in stacks])
        return {
            "visual_pos_masks": visual,
            "deepstack_visual_embeds": list(features.split(self.width, dim=-1)),
        }

    def _interleaved(self, video, audio) -> str:
        """`Qwen3OmniMoeProcessor.replace_video_with_audio_token`: between audio bos and eos,
        the video's tokens and its audio track's merged by time (a video token first on a
        tie)."""
        _, t, h, w, per_grid = video.meta
        seconds = per_grid / 1_000_000  # the towers send it in microseconds
        per_frame = (h // self.merge) * (w // self.merge)
        times = [frame * seconds * self.position_id_per_seconds for frame in range(t)]
        video_index = [time for time in times for _ in range(per_frame)]
        audio_count = audio.meta[0]
        pieces, v, a = [self.audio_bos], 0, 0
        while v < len(video_index) and a < audio_count:
            if video_index[v] <= a:
                pieces.append(self.media_tokens["video"])
                v += 1
            else:
                pieces.append(self.media_tokens["audio"])
                a += 1
        pieces.append(self.media_tokens["video"] * (len(video_index) - v))
        pieces.append(self.media_tokens["audio"] * (audio_count - a))
        return "".join(pieces) + self.audio_eos

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[..., : self.width]).float()

    def prompt_value(self, hidden: torch.Tensor, prompt: Prompt):
        """The prompt's items; on a media prompt, at each media position the placeholder
        token's embedding (the talker finds the media there; `generate`'s talker reads no
        embedding at those positions) and, in the role row of an item's first position
        after the role, the item's kind and integers (`media_header`)."""
        media = prompt.prefill
        if media is None:
            return super().prompt_value(hidden, prompt)
        embeds = prompt.embeds.clone()
        placeholders = self.placeholders(media.ids)
        embeds[placeholders] = self.embed(media.ids[placeholders]).to(embeds.dtype)
        value = self.hidden_value(hidden, embeds, prompt=True)
        for position, kind, meta in media.starts:
            value[position, 2, 1:] = media_header(kind, meta, value.shape[-1] - 1, value.dtype)
        return value

    def hidden_value(self, hidden: torch.Tensor, embeds: torch.Tensor, prompt: bool):
        accepted = hidden[..., self.width :]
        role = torch.full_like(accepted, ROLE_PROMPT if prompt else ROLE_REPLY)
        return torch.stack((accepted, embeds.to(accepted.dtype), role), dim=1)


# --- the talker ---------------------------------------------------------------------------------


@dataclass
class _Conditioning:
    """A talker request's thinker items received so far (on the device)."""

    prompt: list[torch.Tensor] = field(default_factory=list)  # chunks [k, 3, H]
    replies: list[torch.Tensor] = field(default_factory=list)  # embeddings [H]
    user: torch.Tensor | None = None  # [u, D]: the user part, projected
    assistant: list[torch.Tensor] = field(default_factory=list)  # A, projected, [D] each
    projected: int = 0  # replies projected into `assistant` so far
    complete: bool = False  # the prompt's rows are all in and segmented
    # Once they are all in: the prompt's items, and on their way to the host where the
    # markers are, `[L, 8]` bools, and each item's media header columns (`found.more[0]`,
    # `Talker._find_markers`).
    items: torch.Tensor | None = None
    found: HostCopy | None = None
    positions: torch.Tensor | None = None  # [3, 1, u + 9] on a prompt with media
    offset: int = 0  # its decode positions' offset


class Talker(ThinkerFedTalker):
    """The talker and its code predictor: frames of 16 codebooks conditioned on the
    thinker's items and a speaker (the stage's `speaker` parameter, else `generate`'s
    default)."""

    rows_name, adapter = "thinker items", "qwen3_omni.thinker_to_talker"
    state_key, state = _STATE, _Conditioning
    # A prompt position's whole item; a reply's input embedding (the talker projects it).
    prompt_part, reply_part = slice(None), 1

    def __init__(self, model, path: str, layout: dict):
        # The thinker's items, their roles (row 2) read back without waiting.
        super().__init__(model, lambda items: items[:, 2, 0])
        self.finding = Awaited()  # requests' prompt markers on their way to the host
        config = model.config
        self.predictor = model.code_predictor
        self.groups = config.num_code_groups
        tables = self.predictor.model.codec_embedding
        # The talker's and the code predictor's widths agree: nothing projects between them.
        self.frame_spec = FrameSpec(
            predictor=self.predictor.model,
            project=nn.Identity(),
            tables=tables,
            heads=self.predictor.lm_head,
            sampling=_PREDICTOR_SAMPLING,
        )
        self.row_shape = (3, config.thinker_hidden_size)
        vocab = config.text_config.vocab_size
        eos = config.codec_eos_token_id
        self.eos_ids = frozenset({eos})
        self.suppress = tuple(i for i in range(vocab - SUPPRESSED_SPECIALS, vocab) if i != eos)
        self.defaults = talker_defaults(_WHOLE_MODEL)
        self.codec = {name: getattr(config, name) for name in CODEBOOK_OFFSETS}
        self.speakers = {name.lower(): int(i) for name, i in (config.speaker_id or {}).items()}
        self.default_speaker = generate_default("speaker", _WHOLE_MODEL)
        weight = self.embed.weight
        tts = [_top_level(layout, f"tts_{t}_token_id") for t in ("bos", "eos", "pad")]
        keys = ("im_start_token_id", "assistant_token_id", "user_token_id")
        markers = [_top_level(layout, key) for key in keys]
        # The placeholders as generate's multimodal mask reads them, and the media's start
        # markers that its 3-D positions read: the thinker's ids.
        thinker = layout.get("thinker_config") or {}
        media = [
            thinker.get(key, getattr(config, key))
            for key in (
                "audio_token_id",
                "image_token_id",
                "video_token_id",
                "vision_start_token_id",
                "audio_start_token_id",
            )
        ]
        self.marker_ids = [*markers, *media]
        rows = thinker_embedding_rows(path, [*tts, *self.marker_ids]).to(weight.device)
        with torch.inference_mode():
            special = self.model.text_projection(rows[None, :3].to(weight.dtype))[0]
        self.tts_bos, self.tts_eos, self.tts_pad = special.unbind()
        # The thinker's embedding rows of <|im_start|>, `assistant`, `user`, the media
        # placeholders and the media's start markers: where the prompt's turns and media are.
        self.markers = rows[3:]
        if not hasattr(config, "audio_config"):
            # get_rope_index reads the audio encoder's `n_window` (an audio clip's positions
            # beside images or video), which the talker's config lacks: generate raises
            # AttributeError there; here the thinker's audio config's.
            audio = thinker.get("audio_config") or {}
            config.audio_config = SimpleNamespace(n_window=audio.get("n_window", 50))

    # --- conditioning -----------------------------------------------------------------------
    def _received(self, call: Call) -> None:
        """Segment the prompt once all its rows are in (a reply came, or the stream ended):
        find its markers on the device, then, once they have come to the host, segment it
        there (a host sync a request otherwise, stalling the process's other stages)."""
        cond = call.state.get(_STATE)
        ended = self.conditioning.ended(call)
        if cond is None or cond.complete or not (cond.replies or ended):
            return
        try:
            if cond.found is None:
                self._find_markers(call, cond)
            if cond.found.landed():
                self._segment(cond)
                self.finding.taken(call)
        except ARBackendError as err:
            call.fail(err)

    def has_news(self, call: Call) -> bool:
        cond = call.state.get(_STATE)
        markers = cond is not None and not cond.complete and cond.found is not None
        return super().has_news(call) or (markers and cond.found.landed())

    def in_flight(self) -> bool:
        return super().in_flight() or self.finding.in_flight()

    def _find_markers(self, call: Call, cond: _Conditioning) -> None:
        """Where the prompt's `<|im_start|>`, `assistant`, `user`, media placeholders and
        media start markers are, by their embeddings, on the device; its copy to the host
        queued (`cond.found`), with the items' media header columns."""
        if not cond.prompt:
            raise ARBackendError("the thinker sent no prompt rows")
        cond.items = torch.cat(cond.prompt)
        embeds = cond.items[:, 1]
        found = (embeds[:, None] == self.markers.to(embeds.dtype)[None]).all(dim=-1)  # [L, 8]
        heads = cond.items[:, 2, 1 : 1 + MEDIA_HEADER_COLUMNS]
        cond.found = to_host(found, heads)
        self.finding.add(call)

    def _segment(self, cond: _Conditioning) -> None:
        """Project the prompt as `generate` does, its markers on the host: the user part,
        and the assistant's turn's rows, the start of A."""
        items, found = cond.items, cond.found.value
        embeds = items[:, 1]
        im_start, assistant, user = found[:, 0], found[:, 1], found[:, 2]
        media = found[:, 3:6].any(dim=1)
        length = len(items)
        positions = torch.arange(length)
        # Each position's role token: the one after the last <|im_start|> at or before it.
        starts = torch.where(im_start, positions, torch.full_like(positions, -1))
        role = (torch.cummax(starts, dim=0).values.clamp_min(0) + 1).clamp_max(length - 1)
        in_user = user[role]
        opens = (im_start[:-1] & assistant[1:]).nonzero().flatten()
        if not len(opens):
            raise ARBackendError(
                "the talker speaks the assistant's turn, and the prompt has none "
                "(no <|im_start|>assistant)"
            )
        projection = self.model.text_projection
        dtype = self.embed.weight.dtype

        def at(mask: torch.Tensor) -> torch.Tensor:  # its positions, sent without waiting
            return upload(mask.nonzero().flatten(), embeds.device)

        # All the prompt's positions in one projection (as generate does), the user's kept:
        # text positions' embeddings by `text_projection`, media positions' accept-layer
        # states by `hidden_projection`.
        if media.any():
            text_at, media_at = at(~media), at(media)
            rows = embeds.new_empty(length, self.embed.weight.shape[1], dtype=dtype)
            rows.index_copy_(0, text_at, projection(embeds.index_select(0, text_at).to(dtype)))
            accepted = items.index_select(0, media_at)[:, 0].to(dtype)
            rows.index_copy_(0, media_at, self.model.hidden_projection(accepted))
            cond.user = rows.index_select(0, at(in_user))
            heads = cond.found.more[0]
            cond.positions, cond.offset = self._positions(heads, found, in_user, embeds.device)
        else:
            cond.user = projection(embeds.to(dtype)).index_select(0, at(in_user))
        start = int(opens[-1])
        cond.assistant = list(projection(embeds[start:].to(dtype)).unbind())
        cond.complete = True

    def _positions(self, heads: torch.Tensor, found: torch.Tensor, in_user: torch.Tensor, device):
        """The prefill's 3-D positions (sent to `device`) and the decode offset on a prompt
        with media, as `generate` has the talker compute them: its own `get_rope_index` over
        the user part's thinker ids and the assistant part's 9 rows, with the media's grids,
        seconds per grid and audio feature lengths (the integers of each item's first
        position's header, `heads`) and `use_audio_in_video` unset (`generate` does not pass
        it on to the talker). Of the ids it reads only the media markers and placeholders,
        found by their embeddings; the others are -1 here. All on the host (`heads`, `found`
        and `in_user` came there with `cond.found`): get_rope_index reads its inputs back
        item by item, a host sync each on a GPU."""
        ids = torch.full((len(found),), -1, dtype=torch.long)
        for column, token in enumerate(self.marker_ids[3:], start=3):
            ids[found[:, column]] = token
        metas: dict[str, list] = {"image": [], "video": [], "audio": []}
        for position in (heads[:, 0] != 0).nonzero().flatten().tolist():
            header = read_media_header(heads[position])
            if header is None:
                raise ARBackendError(f"the thinker's item {position} has no media header")
            metas[header[0]].append(header[1])
        assistant = ids.new_full((_ASSISTANT_ROWS,), -1)
        talker_ids = torch.cat((ids[in_user], assistant))[None]

        def tensor(kind, pick, dtype=torch.long):
            rows = [pick(meta) for meta in metas[kind]]
            return torch.tensor(rows, dtype=dtype) if rows else None

        positions, delta = self.model.get_rope_index(
            talker_ids,
            tensor("image", lambda m: m[1:4]),
            tensor("video", lambda m: m[1:4]),
            torch.ones_like(talker_ids),
            False,
            tensor("audio", lambda m: m[1]),
            tensor("video", lambda m: m[4] / 1_000_000, torch.float),
        )
        return upload(positions, device), int(delta.reshape(-1)[0])

    def _project_replies(self, cond: _Conditioning, upto: int) -> None:
        """Project the replies received so far that A needs up to row `upto`."""
        first = cond.projected
        last = min(len(cond.replies), upto - (len(cond.assistant) - first) + 1)
        if last > first:
            rows = torch.stack(cond.replies[first:last]).to(self.embed.weight.dtype)
            cond.assistant.extend(self.model.text_projection(rows).unbind())
            cond.projected = last

    def _known(self, call: Call, row: int) -> bool:
        """Whether the text-side row `row` of the request's A stream is known yet."""
        cond = call.state[_STATE]
        prompt_rows = len(cond.assistant) - cond.projected
        return row < prompt_rows + len(cond.replies) or self.conditioning.ended(call)

    def _text(self, cond: _Conditioning, row: int) -> torch.Tensor:
        """Row `row` of A, then tts eos, then tts pad (call once it is known)."""
        self._project_replies(cond, row)
        if row < len(cond.assistant):
            return cond.assistant[row]
        return self.tts_eos if row == len(cond.assistant) else self.tts_pad

    def can_start(self, call: Call) -> bool:
        cond = call.state.get(_STATE)
        if cond is None:  # nothing came: `prompt` fails the request
            return self.conditioning.ended(call)
        return cond.complete and self._known(call, 3)

    def prompt(self, call: Call) -> Prompt:
        cond = call.state.get(_STATE)
        if cond is None:
            raise ARBackendError("the thinker sent no prompt rows")
        speaker = str((call.params or {}).get("speaker") or self.default_speaker)
        if speaker.lower() not in self.speakers:
            raise ARBackendError(
                f"unknown speaker '{speaker}'; this model has "
                + ", ".join(sorted(name.capitalize() for name in self.speakers))
            )
        text = torch.stack(
            [self._text(cond, row) for row in range(3)]
            + [self.tts_pad] * 4
            + [self.tts_bos, self._text(cond, 3)]
        )
        c = self.codec
        ids = [c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"]]
        ids += [self.speakers[speaker.lower()], c["codec_pad_id"], c["codec_bos_id"]]
        codec = self.embed(upload(ids, text.device))
        codec = torch.cat((codec.new_zeros(3, codec.shape[1]), codec))
        embeds = torch.cat((cond.user, text + codec))
        return Prompt(embeds, [], cond.positions, cond.offset)

    def can_step(self, seq: Sequence) -> bool:
        # The prefill fed A[3]; the decode step after n sampled frames feeds A[3 + n].
        return self._known(seq.call, 3 + seq.next_step)

    def step_extra(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's text side of its next step: A[3 + frames sampled], then tts eos, then
        tts pad (added to the last frame's summed codebook embeddings, `frame_spec`)."""
        return torch.stack([self._text(s.call.state[_STATE], 3 + s.next_step) for s in seqs])


# What `generate` has the code predictor sample with when the talker samples: top-k 50,
# top-p 0.8, its generation config's temperature 1.
_PREDICTOR_SAMPLING = sub_sampling(temperature=1.0, top_k=50, top_p=0.8)

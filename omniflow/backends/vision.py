"""The vision encoder backend of `encoder` stages with an `image` input: `VisionEncoder`, a
vision-language checkpoint's vision tower alone, and the layout its embeddings travel in.

The tower is what the stage's model family loads (the plan's `StagePlan.family`: e.g.
Qwen2.5-VL's, `omniflow.families.qwen2_5_vl.vision_tower`), from the checkpoint directory
alone: the language model's weights are skipped, and a tower weight the checkpoint lacks is
an error. The image processor is the checkpoint's own, with its largest size
capped so an image gives at most the stage's `max_len` embeddings (the edge's item holds
`1 + max_len` rows): as Qwen's `max_pixels` does, larger images are resized down.

A request's image is a path to an image file (PNG, JPEG, anything PIL opens) or a uint8
tensor `[H, W, 3]`; anything else, or a file that cannot be read, fails that request alone.
Each image goes through the processor on its own; then ONE tower forward runs every image
of the step: Qwen2.5-VL's tower takes the images' patches concatenated with one
`grid_thw` row per image and attends within each image only, so images of different
sizes share the forward.

What a request emits on `hidden`, in the tower's dtype, is one value `[1, 1 + n, H]`
(`pack_image` writes it, `unpack_image` reads it):

- position 0 is a header: the image's patch grid (t, h, w), the `image_grid_thw` row the
  language model's multimodal RoPE needs, each as two base-256 digits —
  `[0, 0, 2i]` = g_i % 256 and `[0, 0, 2i + 1]` = g_i // 256 for g = (t, h, w) (integers
  below 256 are exact in every float dtype); the rest of the header is zero;
- positions 1 .. n are the merged patch embeddings, n = t * h * w / merge_size², in the
  order the language model's image placeholder tokens take them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omniflow.backends.registry import family_code
from omniflow.catalog.resolve import model_path
from omniflow.dtypes import torch_dtype
from omniflow.errors import OmniflowError
from omniflow.hf_logging import quiet
from omniflow.runtime.stage import Backend, Call, StageSpec

# Grid sizes travel as two base-256 digits: integers up to 256 are exact in bfloat16.
_DIGIT = 256
_GRID = 3  # (t, h, w)


class VisionBackendError(OmniflowError):
    """A vision encoder stage cannot load its model, or a request's image cannot be read."""


def pack_image(embeds: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """An image's embeddings `[n, H]` and patch grid (t, h, w) as one `hidden` value
    `[1, 1 + n, H]`: the grid header, then the embeddings."""
    out = embeds.new_zeros(1, 1 + embeds.shape[0], embeds.shape[1])
    for i, g in enumerate(grid):
        out[0, 0, 2 * i], out[0, 0, 2 * i + 1] = g % _DIGIT, g // _DIGIT
    out[0, 1:] = embeds
    return out


def unpack_image(hidden: torch.Tensor, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_image`'s inverse: the embeddings `[n, H]` (copied out of `hidden`) and the grid,
    an int64 `[1, 3]` `image_grid_thw`. `merge_size` is the tower's spatial merge, which
    says how many embeddings the grid gives."""
    if hidden.dim() != 3 or hidden.shape[0] != 1 or hidden.shape[2] < 2 * _GRID:
        raise VisionBackendError(
            f"image embeddings of shape {list(hidden.shape)} are not the vision encoder's "
            "[1, 1 + tokens, hidden] layout"
        )
    digits = hidden[0, 0, : 2 * _GRID].double().round().long().view(_GRID, 2)
    grid = digits[:, 0] + _DIGIT * digits[:, 1]
    n = int(grid.prod()) // merge_size**2
    if n < 1 or n != hidden.shape[1] - 1:
        raise VisionBackendError(
            f"image embeddings carry grid {grid.tolist()} ({n} tokens at merge size "
            f"{merge_size}) and {hidden.shape[1] - 1} rows: not the vision encoder's layout"
        )
    return hidden[0, 1:].clone(), grid[None]


# How an image processor is told that `read_image`'s arrays are [H, W, C]: left to guess, it
# takes an image one or three pixels high for channels first (a 201 x 1 picture read as a
# grey one of 3 x 201, its aspect ratio misjudged and its pixels scrambled).
CHANNELS_LAST = {"input_data_format": "channels_last"}


def read_image(value):
    """A request's image as the image processor takes it: a path is opened with PIL (as
    RGB), a uint8 `[H, W, 3]` tensor becomes an array."""
    from PIL import Image

    if isinstance(value, str):
        try:
            with Image.open(value) as image:
                return image.convert("RGB")
        except OSError as err:
            raise VisionBackendError(f"cannot read image file '{value}': {err}") from err
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.dim() == 3
        and value.shape[2] == 3
    ):
        return value.cpu().numpy()
    what = (
        f"a {value.dtype} tensor of shape {list(value.shape)}"
        if isinstance(value, torch.Tensor)
        else type(value).__name__
    )
    raise VisionBackendError(
        f"an image is a path to an image file or a uint8 tensor [H, W, 3], not {what}"
    )


def _load_tower(spec: StageSpec, device: str, loaded):
    """The stage's vision tower, alone, and the checkpoint's image processor: what its model
    family's code loaded (called with the checkpoint path, the component and the dtype; it
    returns the tower, its loading info and the processor)."""
    plan = spec.plan
    tower, info, processor = loaded
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise VisionBackendError(
            f"stage '{plan.name}': {plan.model} lacks vision tower weights {', '.join(missing[:5])}"
        )
    config = tower.config
    if (processor.patch_size, processor.merge_size) != (
        config.patch_size,
        config.spatial_merge_size,
    ):
        raise VisionBackendError(
            f"stage '{plan.name}': the image processor's patches ({processor.patch_size} px, "
            f"merge {processor.merge_size}) are not the tower's ({config.patch_size} px, "
            f"merge {config.spatial_merge_size})"
        )
    return tower.to(device).eval(), processor


class VisionEncoder(Backend):
    """A vision-language checkpoint's vision tower: one image per request to its embeddings."""

    def __init__(self, spec: StageSpec, device: str, loaded=None):
        super().__init__(spec, device)
        name = spec.plan.name
        if loaded is None:
            loaded = _load_family(spec, device)
        if spec.inputs != {"image": "image"}:
            given = ", ".join(f"{p}: {t}" for p, t in spec.inputs.items())
            raise VisionBackendError(
                f"stage '{name}': the vision encoder takes one image input, not {given}"
            )
        self.tower, self.processor = _load_tower(spec, device, loaded)
        max_len = spec.plan.settings["max_len"]
        # The largest image that gives at most max_len embeddings, one per merged patch.
        patch = self.processor.patch_size * self.processor.merge_size
        size = self.processor.size
        self.size = {
            "shortest_edge": size["shortest_edge"],
            "longest_edge": min(size["longest_edge"], max_len * patch * patch),
        }
        if self.size["longest_edge"] < self.size["shortest_edge"]:
            raise VisionBackendError(
                f"stage '{name}': max_len {max_len} is below the image processor's smallest "
                f"image ({size['shortest_edge'] // (patch * patch)} tokens)"
            )

    def ready(self, call: Call) -> bool:
        return call.inputs_ended()

    @torch.inference_mode()
    def step(self, calls: list[Call]) -> None:
        owners, pixels, grids = [], [], []
        for call in calls:
            try:
                features = self._features(call.inputs["image"].take())
            except VisionBackendError as err:
                call.fail(err)
                continue
            owners.append(call)
            pixels.append(features["pixel_values"])
            grids.append(features["image_grid_thw"])
        if not owners:
            return
        # Sizes from the processor's grid, on the host: read back from the device, they would
        # wait for the tower's forward and hold up the other stages of the process meanwhile.
        grid = torch.cat(grids)
        sizes = (grid.prod(-1) // self.tower.spatial_merge_size**2).tolist()
        embeds = self.tower(
            torch.cat(pixels).to(self.device, self.tower.dtype), grid_thw=grid.to(self.device)
        ).pooler_output
        for call, mine, thw in zip(owners, embeds.split(sizes), grid.tolist(), strict=True):
            call.emit("hidden", pack_image(mine, tuple(thw)))
            call.finish()

    def _features(self, value):
        """The processor's pixel patches and grid of one request's image."""
        image = read_image(value)
        try:
            return self.processor(
                images=[image], size=self.size, return_tensors="pt", **CHANNELS_LAST
            )
        except ValueError as err:  # e.g. an aspect ratio above 200
            raise VisionBackendError(f"the image processor refuses the image: {err}") from err


# --- several media items per request: images, videos, audio clips -----------------------------

# The kinds of item a media value holds, as its header row's first entry says.
MEDIA_KINDS = ("image", "video", "audio")
_META_DIGITS = 3  # each header integer as 3 base-256 digits: up to 16,777,215, exact in bf16
MAX_MEDIA_INTEGERS = 8  # a header's integers, at most (a video's are 5)
# A header row's leading columns that can hold anything: all a reader needs of a row.
MEDIA_HEADER_COLUMNS = 2 + _META_DIGITS * MAX_MEDIA_INTEGERS


@dataclass
class MediaItem:
    """One encoded media item: its kind, embeddings `[n, H]` and integers that say what the
    language model needs of it besides (`meta[0]` is always n; then e.g. the patch grid
    (t, h, w) of an image, a video's grid and its seconds per grid in microseconds, an audio
    clip's feature length)."""

    kind: str
    embeds: torch.Tensor
    meta: tuple[int, ...]


def media_header(kind: str, meta: tuple[int, ...], width: int, dtype) -> torch.Tensor:
    """An item's header row `[width]`: its kind (1 + its index in MEDIA_KINDS), the count of
    its integers, then each as `_META_DIGITS` base-256 digits, low first (exact in every
    float dtype); the rest zero."""
    if len(meta) > MAX_MEDIA_INTEGERS or 2 + _META_DIGITS * len(meta) > width:
        raise VisionBackendError(f"{len(meta)} header integers do not fit {width} columns")
    row = torch.zeros(width, dtype=dtype)
    row[0] = MEDIA_KINDS.index(kind) + 1
    row[1] = len(meta)
    for i, value in enumerate(meta):
        if not 0 <= value < _DIGIT**_META_DIGITS:
            raise VisionBackendError(f"header integer {value} is out of range")
        for d in range(_META_DIGITS):
            row[2 + _META_DIGITS * i + d] = (value // _DIGIT**d) % _DIGIT
    return row


def read_media_header(row: torch.Tensor) -> tuple[str, tuple[int, ...]] | None:
    """`media_header`'s inverse: (kind, integers), or None if `row` is not a header."""
    head = row.double().round().long().tolist()
    kind, count = head[0], head[1]
    if not 1 <= kind <= len(MEDIA_KINDS) or count < 1 or 2 + _META_DIGITS * count > len(head):
        return None
    meta = tuple(
        sum(head[2 + _META_DIGITS * i + d] * _DIGIT**d for d in range(_META_DIGITS))
        for i in range(count)
    )
    return MEDIA_KINDS[kind - 1], meta


def pack_media(items: list[MediaItem], width: int, dtype) -> torch.Tensor:
    """A request's media items, in the order its chat places them, as one `hidden` value
    `[1, sum(1 + n_i), H]`: each item's header row (`media_header`), then its n
    embeddings."""
    rows = sum(1 + len(item.embeds) for item in items)
    out = torch.zeros(1, rows, width, dtype=dtype)
    at = 0
    for item in items:
        out[0, at] = media_header(item.kind, item.meta, width, dtype)
        out[0, at + 1 : at + 1 + len(item.embeds)] = item.embeds
        at += 1 + len(item.embeds)
    return out


def check_media(hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` if it is a media value's `[1, rows, H]`; VisionBackendError if not."""
    if hidden.dim() != 3 or hidden.shape[0] != 1:
        raise VisionBackendError(
            f"media embeddings of shape {list(hidden.shape)} are not the encoder's "
            "[1, rows, hidden] layout"
        )
    return hidden


def unpack_media(hidden: torch.Tensor, heads: torch.Tensor | None = None) -> list[MediaItem]:
    """`pack_media`'s inverse (the embeddings copied out of `hidden`); its headers read from
    `heads`, its rows' leading MEDIA_HEADER_COLUMNS on the host where given (one copy, made
    without waiting: a header read off a GPU is a host sync per item)."""
    rows = check_media(hidden)[0]
    heads = rows if heads is None else heads
    items, at = [], 0
    while at < len(rows):
        header = read_media_header(heads[at])
        if header is None:
            raise VisionBackendError(f"row {at} of the media embeddings is not an item header")
        kind, meta = header
        n = meta[0]
        if at + 1 + n > len(rows):
            raise VisionBackendError("the media embeddings end inside an item")
        items.append(MediaItem(kind, rows[at + 1 : at + 1 + n].clone(), meta))
        at += 1 + n
    return items


class MediaTower(Protocol):
    """What a model family's encoder loader returns for a media encoder stage.

    - `kinds`: the input port types it encodes ("image", "video", "audio");
    - `width`, `dtype`: its embeddings' width and dtype;
    - `prepare(kind, value)`: one item through the model's own processor (an image file's
      path or a uint8 `[H, W, 3]` tensor; a video file's bytes, 1-D uint8, or its frames
      `[F, H, W, 3]`; 16 kHz mono float32 samples), as an object with a `tokens` attribute
      (the embeddings it will give); raises `VisionBackendError` for an item it refuses;
    - `forward(kind, prepared)`: ONE batched forward over items of one kind, possibly of
      several requests: a `MediaItem` each, in order.
    """

    kinds: frozenset[str]
    width: int
    dtype: torch.dtype

    def prepare(self, kind: str, value) -> Any: ...

    def forward(self, kind: str, prepared: list) -> list[MediaItem]: ...


def encoder_backend(spec: StageSpec, device: str) -> Backend:
    """The transformers backend of an `encoder` stage with media inputs: what the stage's
    model family loads. A (tower, loading info, image processor) triple is a one-image
    vision tower (`VisionEncoder`); a `MediaTower` takes images, videos and audio clips,
    several per request (`MediaEncoder`); a `RequestEncoder` encodes each request's
    values its own way (`RequestEncoderBackend`)."""
    loaded = _load_family(spec, device)
    if isinstance(loaded, tuple):
        return VisionEncoder(spec, device, loaded)
    if isinstance(loaded, RequestEncoder):
        return RequestEncoderBackend(spec, device, loaded)
    return MediaEncoder(spec, device, loaded)


class RequestEncoder(ABC):
    """A family's encoder of whole request values into whole output values (a voice clone's
    reference clip into its voice prompt), one request at a time: `encode` takes the
    values of the stage's input ports (None: the port had nothing, or an empty text or
    tensor; a request with None on every port is stepped beside the stage's `max_batch`,
    `Backend.costs_nothing`, so it must cost next to nothing) and gives those of its
    output ports (a port left out gets nothing). A request it cannot take is an
    OmniflowError, which fails that request alone."""

    @abstractmethod
    def to(self, device: str) -> RequestEncoder: ...

    @abstractmethod
    def encode(self, values: dict[str, Any]) -> dict[str, Any]: ...


class RequestEncoderBackend(Backend):
    """Runs a `RequestEncoder`: each ready call's inputs, whole, through `encode`."""

    def __init__(self, spec: StageSpec, device: str, encoder: RequestEncoder):
        super().__init__(spec, device)
        self.encoder = encoder

    def ready(self, call: Call) -> bool:
        return call.inputs_ended()

    def costs_nothing(self, call: Call) -> bool:
        """A request with nothing on any input (an empty text, or no chunk) has nothing to
        encode: `encode` sees None for each."""
        return not any(_content(chunk) for s in call.inputs.values() for chunk in s.chunks)

    def step(self, calls: list[Call]) -> None:
        for call in calls:
            values = {port: stream.take() for port, stream in call.inputs.items()}
            values = {port: value if _content(value) else None for port, value in values.items()}
            try:
                encoded = self.encoder.encode(values)
            except OmniflowError as err:
                call.fail(err)
                continue
            for port, value in encoded.items():
                call.emit(port, value)
            call.finish()


def _content(value) -> bool:
    """Whether an input value holds anything: neither None, nor an empty text or tensor."""
    if value is None or isinstance(value, str):
        return bool(value)
    return not isinstance(value, torch.Tensor) or value.numel() > 0


def _load_family(spec: StageSpec, device: str):
    plan = spec.plan
    load = family_code(spec, "transformers")
    if load is None:
        family = plan.family.name if plan.family else "no model family"
        raise VisionBackendError(
            f"stage '{plan.name}': {plan.model} ({family}) has no media encoder omniflow can run"
        )
    path = model_path(plan.model)
    dtype = plan.settings.get("dtype")
    try:
        with quiet():
            loaded = load(path, plan.component, torch_dtype(dtype) if dtype else "auto")
    except (OSError, ValueError, KeyError) as err:
        raise VisionBackendError(f"stage '{plan.name}': cannot load {plan.model}: {err}") from err
    if not isinstance(loaded, tuple):
        loaded.to(device)
    return loaded


class MediaEncoder(Backend):
    """A model's media towers: every item of every request in the step through the model's
    processor, then one tower forward per kind of item for all of them; each request emits
    one `hidden` value, its items packed in the order of its inputs (`pack_media`) and
    finishes. A request with no items (its optional inputs left out) emits nothing."""

    def __init__(self, spec: StageSpec, device: str, tower: MediaTower):
        super().__init__(spec, device)
        name = spec.plan.name
        other = {p: t for p, t in spec.inputs.items() if t not in tower.kinds}
        if other:
            given = ", ".join(f"{p}: {t}" for p, t in other.items())
            raise VisionBackendError(
                f"stage '{name}': its tower ({spec.plan.component}) encodes "
                f"{', '.join(sorted(tower.kinds))}, not {given}"
            )
        self.tower = tower
        self.max_rows = 1 + spec.plan.settings["max_len"]

    def ready(self, call: Call) -> bool:
        return call.inputs_ended()

    @torch.inference_mode()
    def step(self, calls: list[Call]) -> None:
        wanted: dict[str, list] = {kind: [] for kind in MEDIA_KINDS}
        plans = []
        for call in calls:
            try:
                mine = self._prepare(call)
            except VisionBackendError as err:
                call.fail(err)
                continue
            if not mine:
                call.finish()
                continue
            slots = []
            for kind, prepared in mine:
                slots.append((kind, len(wanted[kind])))
                wanted[kind].append(prepared)
            plans.append((call, slots))
        done = {
            kind: self.tower.forward(kind, prepared)
            for kind, prepared in wanted.items()
            if prepared
        }
        for call, slots in plans:
            items = [done[kind][i] for kind, i in slots]
            call.emit("hidden", pack_media(items, self.tower.width, self.tower.dtype))
            call.finish()

    def _prepare(self, call: Call) -> list:
        mine, rows = [], 0
        for port, kind in self.spec.inputs.items():
            value = call.inputs[port].take()
            if value is None:
                continue
            for i, item in enumerate(value if isinstance(value, list) else [value]):
                try:
                    prepared = self.tower.prepare(kind, item)
                except VisionBackendError as err:
                    raise VisionBackendError(f"input '{port}' item {i}: {err}") from err
                mine.append((kind, prepared))
                rows += 1 + prepared.tokens
        if rows > self.max_rows:
            raise VisionBackendError(
                f"the request's media give {rows} embedding and header rows; stage "
                f"'{self.spec.plan.name}' was compiled for {self.max_rows} (max_len "
                f"{self.max_rows - 1})"
            )
        return mine

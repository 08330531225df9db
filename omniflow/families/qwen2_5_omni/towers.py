"""Qwen2.5-Omni's thinker towers alone, as media encoder stages (the transformers `encoder`
backend's `MediaTower`, `omniflow.backends.vision`): the audio tower (`audio_tower`) and the
vision tower (`visual`, images and video frames).

Each item goes through the model's own processing, as `Qwen2_5OmniProcessor` does:

- audio: 16 kHz mono samples through the checkpoint's `WhisperFeatureExtractor`
  (`padding="max_length"`, its attention mask: at most 30 s), the mel frames the mask keeps;
  the tower runs every clip of the step at once (`encode_clips`: what the thinker's
  `get_audio_features` does with a batch). An item's integers: (tokens, feature length) —
  `get_rope_index` needs the feature length;
- images: the checkpoint's image processor (`Qwen2VLImageProcessor`'s settings);
- videos: a video file's frames sampled as the processor's `sample_frames` does at 2 frames
  a second (the fps Qwen2.5-Omni's processor assumes: `second_per_grid` = temporal patch 2 / 2
  fps), or frames given as a tensor taken as sampled already; each frame resized (bicubic,
  `smart_resize` within the video processor's pixel bounds), rescaled and normalised as
  the image processor does, then patched as `Qwen2VLVideoProcessor.patchify` does (two frames a
  temporal patch, the last frame repeated to an even count). `Qwen2VLVideoProcessor` itself
  needs torchvision, which is not installed here: this is its arithmetic with Pillow's
  bicubic resize instead of torchvision's. An item's integers: (tokens, t, h, w, seconds per
  grid in microseconds).

Loading: the tower's class `from_pretrained` on the whole checkpoint with the thinker's
sub-config and its weights' prefix mapped away: only the tower's tensors load.
"""

from __future__ import annotations

import functools
import importlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from omniflow.backends.cuda_graphs import Graphs
from omniflow.backends.static_decode import batch_buckets
from omniflow.backends.vision import CHANNELS_LAST, MediaItem, VisionBackendError, read_image

SAMPLE_RATE = 16000
# What Qwen2.5-Omni's processor and qwen-omni-utils assume of a video: 2 frames a second,
# 4 to 768 frames, a pixel budget per frame (Qwen2_5OmniProcessor.videos_kwargs).
VIDEO_FPS = 2.0
VIDEO_DEFAULTS = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
    "min_frames": 4,
    "max_frames": 768,
    "fps": VIDEO_FPS,
}
VIDEO_CONFIG = "video_preprocessor_config.json"
_US = 1_000_000


@dataclass
class Prepared:
    """One item through the processor: its embeddings' count, the tower's input for it and
    the integers its `MediaItem` carries."""

    tokens: int
    features: torch.Tensor
    meta: tuple[int, ...]


def load(path: str, component: str | None, dtype):
    """The tower `component` ("audio_tower" or "visual") of the checkpoint at `path`."""
    return load_tower(path, component, dtype, (AudioTower, VisionTower), "Qwen2.5-Omni")


def media_tokens(stage, path: str):
    """`Family.media_tokens`: the `MediaCount` of a stage running one of the towers."""
    return count_tokens(stage, path, MediaCount)


def count_tokens(stage, path: str, counting: type):
    """A tower stage's `counting` (a `MediaCount` class) of the checkpoint at `path`; None
    for any other stage."""
    if stage.kind != "encoder" or stage.component not in ("audio_tower", "visual"):
        return None
    return counting(path, thinker_config(path))


def thinker_config(path: str):
    """The thinker's config of the Qwen omni checkpoint at `path` (or of a thinker alone)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return getattr(config, "thinker_config", config)


def load_tower(path: str, component: str | None, dtype, classes: tuple[type, type], model: str):
    """The tower `component` of the `model` checkpoint at `path` (a Qwen omni one, or its
    thinker's alone), by its class in `classes`: the audio tower's and the vision tower's."""
    thinker = thinker_config(path)
    audio, vision = classes
    if component == "audio_tower":
        return audio(path, thinker, dtype)
    if component == "visual":
        return vision(path, thinker, dtype)
    raise VisionBackendError(
        f"{model}'s towers are the components 'audio_tower' and 'visual', not '{component}'"
    )


def transformers_class(model: str, name: str):
    """The class `name` of transformers' modeling module of the model type `model`, imported
    only when a tower loads."""
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)


def tower_from_pretrained(encoder: tuple[str, str], path, config, prefix, dtype):
    """The tower class `encoder` (model type, class name: `transformers_class`) with
    `config`, its weights those of the checkpoint at `path` under `prefix` (the rest of the
    checkpoint skipped); a weight it lacks is an error."""
    model, info = transformers_class(*encoder).from_pretrained(
        path,
        config=config,
        key_mapping={rf"^{prefix}\.": ""},
        dtype=dtype,
        output_loading_info=True,
    )
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise VisionBackendError(f"{path} lacks {prefix} weights {', '.join(missing[:5])}")
    return model.eval()


class MediaCount:
    """The embeddings each media item gives the towers of the checkpoint at `path`, from its
    size alone (a clip's samples; a picture's width and height; a video's too, with its
    frames as its header declares them), by the towers' own arithmetic, which their
    `prepare` counts with: what admission counts against the stages' `max_len` before any
    stage runs. It loads the processors' settings and no weights, and decodes nothing.
    (A subclass for another model's towers gives its video defaults and its audio
    arithmetic.)"""

    video_defaults = VIDEO_DEFAULTS

    def __init__(self, path: str, thinker):
        from transformers import AutoImageProcessor, WhisperFeatureExtractor

        self.extractor = WhisperFeatureExtractor.from_pretrained(path)
        # The PIL backend whatever is installed: `video_patches` takes the frames through its
        # numpy steps, which the torchvision backend (transformers' default where
        # torchvision is installed) does not take.
        self.images = AutoImageProcessor.from_pretrained(path, backend="pil")
        self.video = video_settings(path, self.video_defaults)
        self.merge = thinker.vision_config.spatial_merge_size
        self.temporal = thinker.vision_config.temporal_patch_size

    def __call__(self, kind: str, value) -> int:
        """One item's embeddings: an audio clip's (float samples `[n]`), an image's (`[H,
        W, C]`), a video's (its file's bytes, uint8 `[N]`, or frames `[F, H, W, 3]`); 0 where
        its size cannot be read or is one its stage refuses (the stage says why)."""
        shape = tuple(getattr(value, "shape", ()))
        try:
            if kind == "audio" and len(shape) == 1:
                return self.audio_tokens(self.audio_length(shape[0]))
            if kind == "image" and len(shape) == 3:
                return self.image_tokens(*shape[:2])
            if kind == "video" and len(shape) == 4:
                return self.video_tokens(*shape[:3])
            if kind == "video" and len(shape) == 1:
                from omniflow.media import video_header

                info = video_header(value.numpy().tobytes())
                frames = sample_indices(info.frames, info.rate, self.video, self.temporal)
                return self.video_tokens(len(frames), info.height, info.width)
        except (VisionBackendError, ValueError):  # (a MediaError is a ValueError)
            pass
        return 0

    def audio_length(self, samples: int) -> int:
        """The feature frames `audio_features` keeps of a clip of `samples`: those the
        extractor's attention mask marks, one a hop begun within its 30 s window."""
        within = min(samples, self.extractor.n_samples)
        return -(-within // self.extractor.hop_length)

    def audio_tokens(self, length: int) -> int:
        """The embeddings a clip of `length` feature frames gives."""
        from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
            _get_feat_extract_output_lengths,
        )

        return int(_get_feat_extract_output_lengths(length))

    def image_tokens(self, height: int, width: int) -> int:
        patches = self.images.get_number_of_image_patches(height, width, {})
        return patches // self.merge**2

    def video_tokens(self, frames: int, height: int, width: int) -> int:
        """A video's embeddings, of `frames` sampled frames (the last repeated to a whole
        temporal patch, as `video_patches` does)."""
        h, w = video_resize(height, width, self.images, self.video, self.merge)
        patch = self.images.patch_size * self.merge
        return -(-frames // self.temporal) * (h // patch) * (w // patch)


class AudioTower:
    """The thinker's audio tower on 16 kHz clips. (A subclass for another model's tower
    gives its class (`encoder`), its processor's feature options, its token count and its
    forward.)"""

    kinds = frozenset({"audio"})
    prefix = "thinker.audio_tower"
    encoder = ("qwen2_5_omni", "Qwen2_5OmniAudioEncoder")  # its transformers class
    # Qwen2_5OmniProcessor's audio kwargs: every clip padded to the extractor's 30 s window.
    feature_options = {"padding": "max_length"}
    counting = MediaCount  # (a subclass for another model's towers)

    def __init__(self, path: str, thinker, dtype):
        self.model = tower_from_pretrained(
            self.encoder, path, thinker.audio_config, self.prefix, dtype
        )
        self.count = self.counting(path, thinker)
        self.extractor = self.count.extractor
        self.width = thinker.audio_config.output_dim
        self.dtype = self.model.dtype
        self.graphs: Graphs | None = None
        self.feature_device = "cpu"

    def to(self, device: str) -> None:
        self.model.to(device)
        on_cuda = torch.device(device).type == "cuda"
        self.graphs = self.layer_graphs() if on_cuda else None
        # On a GPU the features' STFT runs there too (transformers' own batched path, within
        # 1e-5 of the CPU's): the host's share of the step then is the checks and copies.
        self.feature_device = str(device) if on_cuda else "cpu"

    def layer_graphs(self) -> Graphs | None:
        """The CUDA graphs `encode` replays (`clip_graphs`), captured once on the GPU."""
        return clip_graphs(self.model, capture=True)

    def prepare(self, kind: str, value) -> Prepared:
        features, length = audio_features(
            self.extractor, value, device=self.feature_device, **self.feature_options
        )
        tokens = self.count.audio_tokens(length)
        return Prepared(tokens, features, (tokens, length))

    def forward(self, kind: str, prepared: list[Prepared]) -> list[MediaItem]:
        features = torch.cat([p.features for p in prepared], dim=1)
        embeds = self.encode(features, [p.meta[1] for p in prepared])
        embeds = embeds.split([p.tokens for p in prepared])
        return [MediaItem("audio", e, p.meta) for e, p in zip(embeds, prepared, strict=True)]

    def encode(self, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The clips' features `[mel, sum(lengths)]` (on the host), concatenated, to their
        embeddings on the tower's device (what the thinker's `get_audio_features` does with a
        batch), in one pass (`encode_clips`), replaying `graphs` where it has them."""
        return encode_clips(self.model, features, lengths, self.graphs)


def audio_features(extractor, value, device: str = "cpu", **options) -> tuple[torch.Tensor, int]:
    """A clip's log-mel features `[mel, frames]` (on the host) as the processor makes them
    (`options`: its audio kwargs, e.g. `padding="max_length"`: to the extractor's 30 s window,
    which cuts a longer clip there), computed on `device`, and their length: what the
    feature extractor's attention mask keeps."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or not value.is_floating_point():
        what = (
            f"a {value.dtype} tensor of shape {list(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise VisionBackendError(f"an audio clip is 16 kHz mono float samples [n], not {what}")
    if not len(value) or not torch.isfinite(value).all():
        raise VisionBackendError("the audio clip is empty or not finite")
    if options.get("padding") == "max_length" and "max_length" not in options:
        # Padded to the 30 s window, the frames the mask keeps see at most n_fft / 2 samples
        # past the clip, so padding n_fft of silence makes the same frames (under the same
        # maximum, which sets the log-mel floor) at a fraction of the cost: 5 s in ~8 ms
        # instead of ~120 ms on a CPU core.
        options = {**options, "max_length": min(len(value) + extractor.n_fft, extractor.n_samples)}
    out = extractor(
        value.float().numpy(),
        sampling_rate=SAMPLE_RATE,
        return_attention_mask=True,
        return_tensors="pt",
        device=device,
        **options,
    )
    mask = out["attention_mask"][0].bool()
    return out["input_features"][0][:, mask], int(mask.sum())


class VisionTower:
    """The thinker's vision tower on images and videos. (A subclass for another model's
    tower gives its class (`encoder`), its video processor's defaults, its width and its
    forward.)"""

    kinds = frozenset({"image", "video"})
    prefix = "thinker.visual"
    encoder = ("qwen2_5_omni", "Qwen2_5OmniVisionEncoder")  # its transformers class
    counting = MediaCount  # (a subclass for another model's towers)

    def __init__(self, path: str, thinker, dtype):
        self.model = tower_from_pretrained(
            self.encoder, path, thinker.vision_config, self.prefix, dtype
        )
        count = self.counting(path, thinker)
        self.images, self.video = count.images, count.video
        self.merge, self.temporal = count.merge, count.temporal
        self.width = thinker.vision_config.out_hidden_size
        self.dtype = self.model.dtype

    def to(self, device: str) -> None:
        self.model.to(device)

    def prepare(self, kind: str, value) -> Prepared:
        if kind == "image":
            try:
                out = self.images(images=[read_image(value)], return_tensors="pt", **CHANNELS_LAST)
            except ValueError as err:
                raise VisionBackendError(f"the image processor refuses the image: {err}") from err
            grid = out["image_grid_thw"][0]
            tokens = int(grid.prod()) // self.merge**2
            return Prepared(tokens, out["pixel_values"], (tokens, *map(int, grid)))
        frames = sample_frames(value, self.video, self.temporal)
        pixels, grid = video_patches(frames, self.images, self.video, self.temporal, self.merge)
        tokens = int(grid.prod()) // self.merge**2
        per_grid = round(self.temporal / self.video["fps"] * _US)
        return Prepared(tokens, pixels, (tokens, *map(int, grid), per_grid))

    def forward(self, kind: str, prepared: list[Prepared]) -> list[MediaItem]:
        device = self.model.patch_embed.proj.weight.device
        grids = torch.tensor([p.meta[1:4] for p in prepared], device=device)
        pixels = torch.cat([p.features for p in prepared]).to(device, self.dtype)
        embeds = self.encode(pixels, grids).split([p.tokens for p in prepared])
        return [MediaItem(kind, e, p.meta) for e, p in zip(embeds, prepared, strict=True)]

    def encode(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """The items' patches, concatenated, to their rows `[sum(tokens), width]`."""
        return self.model(pixels, grid_thw=grids).pooler_output


def video_settings(path: str | Path, defaults: dict = VIDEO_DEFAULTS) -> dict:
    """The checkpoint's video processor settings (`video_preprocessor_config.json`), else the
    processor's own (`defaults`)."""
    file = Path(path) / VIDEO_CONFIG
    settings = dict(defaults)
    if file.is_file():
        saved = json.loads(file.read_text(encoding="utf-8"))
        settings |= {k: saved[k] for k in defaults if saved.get(k) is not None}
    return settings


def sample_frames(value, settings: dict, temporal: int) -> torch.Tensor:
    """A video's frames as the model sees them: a file's (1-D uint8 bytes) sampled at the
    processor's fps with `Qwen2VLVideoProcessor.sample_frames`' arithmetic (only the sampled
    frames are kept as the file decodes); a uint8 `[F, H, W, 3]` tensor as it is (sampled
    already)."""
    from omniflow.media import MediaError, decode_video

    if isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 4:
        if value.shape[-1] != 3 or not value.shape[0]:
            raise VisionBackendError(f"video frames are [F, H, W, 3], not {list(value.shape)}")
        return value
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1):
        raise VisionBackendError("a video is a video file's bytes or uint8 frames [F, H, W, 3]")
    pick = functools.partial(sample_indices, settings=settings, temporal=temporal)
    try:
        frames, _, _ = decode_video(value.numpy().tobytes(), pick=pick)
    except MediaError as err:
        raise VisionBackendError(str(err)) from err
    return frames


def sample_indices(total: int, rate: float, settings: dict, temporal: int) -> list[int]:
    """The frames `Qwen2VLVideoProcessor.sample_frames` keeps of `total` at `rate` fps."""
    if total < 1 or rate <= 0:
        raise VisionBackendError("the video has no frames or no frame rate")
    most = math.floor(min(settings["max_frames"], total) / temporal) * temporal
    count = total / rate * settings["fps"]
    count = min(max(count, settings["min_frames"]), most, total)
    count = math.floor(count / temporal) * temporal
    if count < temporal:
        raise VisionBackendError(f"the video has {total} frame(s); the model needs {temporal}")
    return torch.arange(0, total, total / count).int().tolist()


def video_resize(height: int, width: int, images, settings: dict, merge: int) -> tuple[int, int]:
    """The (height, width) `Qwen2VLVideoProcessor` resizes a video's frames to: `smart_resize`
    within its pixel bounds, to multiples of the image processor's merged patch."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        return smart_resize(
            height,
            width,
            factor=images.patch_size * merge,
            min_pixels=settings["size"]["shortest_edge"],
            max_pixels=settings["size"]["longest_edge"],
        )
    except ValueError as err:
        raise VisionBackendError(f"the video processor refuses the video: {err}") from err


def video_patches(frames: torch.Tensor, images, settings: dict, temporal: int, merge: int):
    """`Qwen2VLVideoProcessor`'s pixel patches `[t*h*w, C*T*P*P]` and grid (t, h, w) of
    sampled frames, each frame resized and normalised by the image processor's own steps."""
    patch = images.patch_size
    h, w = video_resize(*frames.shape[1:3], images, settings, merge)
    done = []
    for frame in frames.numpy():
        chw = np.ascontiguousarray(frame.transpose(2, 0, 1))
        chw = _resize(images, chw, h, w)
        chw = images.rescale(chw, images.rescale_factor)
        chw = images.normalize(chw, images.image_mean, images.image_std)
        done.append(torch.from_numpy(np.asarray(chw, dtype=np.float32)))
    video = torch.stack(done)[None]  # [1, F, C, h, w]
    if pad := -video.shape[1] % temporal:
        video = torch.cat((video, video[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
    _, count, channel = video.shape[:3]
    gt, gh, gw = count // temporal, h // patch, w // patch
    patches = video.view(
        1, gt, temporal, channel, gh // merge, merge, patch, gw // merge, merge, patch
    )
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = patches.reshape(gt * gh * gw, channel * temporal * patch * patch)
    return flat, torch.tensor([gt, gh, gw])


def _resize(images, chw: np.ndarray, h: int, w: int) -> np.ndarray:
    """One frame `[C, H, W]` to (h, w) with the image processor's PIL resampling (bicubic)."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(chw.transpose(1, 2, 0)))
    resized = image.resize((w, h), resample=images.resample)
    return np.asarray(resized).transpose(2, 0, 1)


# Steps of up to this many 2 s chunks (a minute of audio) replay CUDA graphs of the tower's
# layers: such steps are bound by the host launching ~600 kernels (an H200 ran a 5 s clip's
# in 2.9 ms and the host took ~15 ms to launch them); larger ones keep the GPU busy as they are.
GRAPH_CHUNKS = 32


def clip_graphs(model, capture: bool) -> Graphs:
    """The tower's layers (`tower_layers`) over 1 .. GRAPH_CHUNKS full-window chunks, in the
    chunk-count buckets of `batch_buckets`: captured as CUDA graphs when `capture` (largest
    first, into one pool), else run eagerly on the same static buffers."""
    device = model.conv1.weight.device
    graphs = Graphs(device, capture)
    window = model.n_window * 2
    positions = (window - 1) // 2 + 1
    mel = model.conv1.in_channels
    for i, chunks in enumerate(reversed(batch_buckets(GRAPH_CHUNKS))):
        keys = torch.zeros(chunks, positions, dtype=torch.bool, device=device)
        keys[:, 0] = True  # a row never copied into stays finite (it attends to one key)
        inputs = {
            "frames": torch.zeros(
                chunks, mel, window, dtype=model.conv1.weight.dtype, device=device
            ),
            "kept": torch.zeros(chunks, 1, window, dtype=torch.bool, device=device),
            "keys": keys,
        }
        graphs.add(chunks, functools.partial(tower_layers, model), inputs, warm_up=i == 0)
    graphs.synchronize()
    return graphs


def encode_clips(
    model, features: torch.Tensor, lengths: list[int], graphs: Graphs | None = None
) -> torch.Tensor:
    """`Qwen2_5OmniAudioEncoder.forward` on clips' features `[mel, sum(lengths)]`, as one
    launch of every kernel and no read-back: the chunks' layout is worked out here from the
    host's lengths, and each layer attends within all chunks at once (one masked attention,
    padded to the longest chunk) where transformers' non-flash path reads the lengths back
    and calls attention chunk by chunk. With `graphs` (`clip_graphs`), a step of up to
    GRAPH_CHUNKS chunks pads them to a full window and replays the layers' graph of its
    bucket. The same embeddings `[tokens, output_dim]`, row for row."""
    device = model.conv1.weight.device
    window = model.n_window * 2
    chunks = [min(window, n - at) for n in lengths for at in range(0, n, window)]
    bucket = next((b for b in batch_buckets(GRAPH_CHUNKS) if b >= len(chunks)), None)
    replay = graphs is not None and bucket is not None
    longest = window if replay else max(chunks)
    padded = torch.zeros(len(chunks), features.shape[0], longest, dtype=features.dtype)
    for i, (piece, size) in enumerate(zip(features.split(chunks, dim=1), chunks, strict=True)):
        padded[i, :, :size] = piece
    frames = torch.tensor(chunks)
    kept = (torch.arange(longest) < frames[:, None])[:, None]  # [chunks, 1, frames]
    after = (frames - 1) // 2 + 1  # positions after the stride-2 conv
    width = (longest - 1) // 2 + 1
    keys = torch.arange(width) < after[:, None]  # [chunks, positions]
    valid = keys.flatten().nonzero().squeeze(-1)
    clip_after = (torch.tensor(lengths) - 1) // 2 + 1
    pooled = (clip_after - 2) // 2 + 1
    starts = torch.cat((torch.zeros(1, dtype=torch.long), clip_after.cumsum(0)[:-1]))
    pairs = torch.cat([s + 2 * torch.arange(p) for s, p in zip(starts, pooled, strict=True)])
    to = {"device": device, "non_blocking": True}
    x = padded.pin_memory() if device.type == "cuda" else padded
    inputs = {"frames": x.to(**to).to(model.conv1.weight.dtype), "kept": kept.to(**to),
              "keys": keys.to(**to)}  # fmt: skip
    x = graphs.run(bucket, inputs) if replay else tower_layers(model, **inputs)
    x = x[: len(chunks)].reshape(-1, x.shape[-1])[valid.to(**to)]
    pairs = pairs.to(**to)
    x = (x[pairs] + x[pairs + 1]) / 2
    return model.proj(model.ln_post(x))


def tower_layers(model, frames: torch.Tensor, kept: torch.Tensor, keys: torch.Tensor):
    """The tower's convolutions and layers on chunks' frames `[chunks, mel, window]` (`kept`:
    the frames of each chunk, `[chunks, 1, window]`; `keys`: the positions after the strided
    convolution, `[chunks, positions]`): `[chunks, positions, width]`, each chunk attending
    within itself. Device work only (no read-back), so it can be captured."""
    positions = keys.shape[1]
    x = torch.nn.functional.gelu(model.conv1(frames)) * kept
    x = torch.nn.functional.gelu(model.conv2(x)).transpose(1, 2)
    x = x + model.positional_embedding.positional_embedding[:positions].to(x.dtype)
    mask = keys[:, None, None, :]  # [chunks, 1, 1, positions]: keys in the chunk
    for layer in model.layers:
        x = x + _chunk_attention(layer.self_attn, layer.self_attn_layer_norm(x), mask)
        y = layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
        x = x + y
        if x.dtype == torch.float16:
            bound = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-bound, bound)
    return x


def _chunk_attention(attn, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The audio tower's self-attention within each chunk `[chunks, positions, width]`."""
    chunks, positions, _ = x.shape
    heads = attn.num_heads

    def split(proj):
        return proj(x).view(chunks, positions, heads, -1).transpose(1, 2)

    out = torch.nn.functional.scaled_dot_product_attention(
        split(attn.q_proj),
        split(attn.k_proj),
        split(attn.v_proj),
        attn_mask=mask,
        scale=attn.scaling,
    )
    return attn.out_proj(out.transpose(1, 2).reshape(chunks, positions, -1))

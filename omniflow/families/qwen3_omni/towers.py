"""Qwen3-Omni's thinker towers alone, as media encoder stages (the transformers `encoder`
backend's `MediaTower`, `omniflow.backends.vision`): the audio tower (`audio_tower`, the AuT
encoder) and the vision tower (`visual`, images and video frames). They are Qwen2.5-Omni's
(`omniflow.families.qwen2_5_omni.towers`: the same processing steps, the same item layout)
with what `Qwen3OmniMoeProcessor` and the Qwen3-Omni classes do differently:

- audio: the processor's audio kwargs are `padding=True, truncation=False` — a clip is
  not padded or cut to a 30 s window, its features are all its mel frames; its
  embeddings' count is `_get_feat_extract_output_lengths(length, n_window)` (13 per
  100-frame chunk, then the remainder's); the tower runs clips concatenated with their
  lengths, as the thinker's `get_audio_features` does a batch. An item's integers:
  (tokens, feature length). Each clip is processed and encoded as it is alone (as the
  processor and the thinker do a request with one clip): the processor pads the clips of
  one call to the longest, and the encoder pads each chunk of a forward to the longest
  chunk there, both of which change a shorter clip's last embeddings; so one forward runs
  only clips whose chunks pad alike (`AudioTower.forward`).
- images: the checkpoint's image processor (16 px patches, merged 2 x 2);
- videos: as Qwen2.5-Omni's, within the processor's pixel bounds per frame (128 to 768
  merged patches of 32 px) at the checkpoint video processor's frames per second (2 if it
  says none); seconds per grid = temporal patch / that fps, what the processor computes
  when given the fps it sampled at (without one it assumes 1 fps).
- the vision tower's output: its merged embeddings `pooler_output` and, beside them, the
  deepstack features of its `deepstack_visual_indexes` layers (each `out_hidden_size`
  wide), concatenated along the width: an item's rows are `[n, (1 + D) * H]`, which the
  thinker splits again (`vision_hidden_width` is the compiler's width of that edge).

Loading: the tower's class `from_pretrained` on the whole checkpoint with the thinker's
sub-config and its weights' prefix mapped away: only the tower's tensors load.
"""

from __future__ import annotations

import torch

from omniflow.backends.vision import MediaItem
from omniflow.families.qwen2_5_omni import towers
from omniflow.families.qwen3_omni import vision_hidden_width

# Qwen3OmniMoeProcessor's audio kwargs (`padding=True`: to the longest clip of the call).
FEATURE_OPTIONS = {"padding": "longest", "truncation": False}
# What Qwen3OmniMoeProcessor assumes of a video: its pixel budget per frame (videos_kwargs),
# and the video processor's frame sampling (Qwen2VLVideoProcessor: 4 to 768 frames), at
# 2 frames a second unless the checkpoint says otherwise.
VIDEO_DEFAULTS = {
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32},
    "min_frames": 4,
    "max_frames": 768,
    "fps": 2.0,
}


def load(path: str, component: str | None, dtype):
    """The tower `component` ("audio_tower" or "visual") of the checkpoint at `path`."""
    return towers.load_tower(path, component, dtype, (AudioTower, VisionTower), "Qwen3-Omni")


def media_tokens(stage, path: str):
    """`Family.media_tokens`: the `MediaCount` of a stage running one of the towers."""
    return towers.count_tokens(stage, path, MediaCount)


class MediaCount(towers.MediaCount):
    """The embeddings each media item gives Qwen3-Omni's towers, from its size alone."""

    video_defaults = VIDEO_DEFAULTS

    def __init__(self, path: str, thinker):
        super().__init__(path, thinker)
        self.n_window = thinker.audio_config.n_window

    def audio_length(self, samples: int) -> int:
        """Every whole hop of the clip: its features uncut and unpadded (FEATURE_OPTIONS)."""
        return samples // self.extractor.hop_length

    def audio_tokens(self, length: int) -> int:
        output_lengths = towers.transformers_class(
            "qwen3_omni_moe", "_get_feat_extract_output_lengths"
        )
        return int(output_lengths(torch.tensor(length), self.n_window))


class AudioTower(towers.AudioTower):
    """The thinker's audio tower (AuT) on 16 kHz clips."""

    feature_options = FEATURE_OPTIONS
    encoder = ("qwen3_omni_moe", "Qwen3OmniMoeAudioEncoder")
    counting = MediaCount

    def forward(self, kind: str, prepared: list[towers.Prepared]) -> list[MediaItem]:
        """One forward per group of clips whose chunks the encoder pads alike: it pads every
        100-frame chunk of a forward to the longest chunk there, and its convolutions see
        that padding at a short chunk's end, so a clip is encoded as it is alone only
        beside clips whose longest chunk is its own (a clip of a full chunk or more: 100
        frames; a shorter one: its length)."""
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(min(p.meta[1], 2 * self.count.n_window), []).append(i)
        out: list[MediaItem | None] = [None] * len(prepared)
        for members in groups.values():
            done = super().forward(kind, [prepared[i] for i in members])
            for i, item in zip(members, done, strict=True):
                out[i] = item
        return out

    def layer_graphs(self) -> None:
        """None: this tower runs through transformers' forward (`encode`)."""
        return None

    def encode(self, features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        device = self.model.conv2d1.weight.device
        lengths = torch.tensor(lengths, device=device)
        return self.model(features.to(device, self.dtype), feature_lens=lengths).last_hidden_state


class VisionTower(towers.VisionTower):
    """The thinker's vision tower on images and videos: each item's embeddings with its
    deepstack features beside them."""

    encoder = ("qwen3_omni_moe", "Qwen3OmniMoeVisionEncoder")
    counting = MediaCount

    def __init__(self, path: str, thinker, dtype):
        super().__init__(path, thinker, dtype)
        self.width = vision_hidden_width(thinker.vision_config.to_dict())

    def encode(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        out = self.model(pixels, grid_thw=grids)
        return torch.cat((out.pooler_output, *out.deepstack_features), dim=-1)

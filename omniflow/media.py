"""Pipeline outputs as files people open, and files people send as pipeline inputs.

Audio is encoded and decoded with soundfile (libsndfile: WAV, FLAC), images with Pillow
(PNG, JPEG, WebP), videos with FFmpeg through PyAV (H.264 in MP4). An audio output is mono
int16 or float samples in [-1, 1]; an image is a uint8 `[H, W, 3]` tensor, a video uint8
frames `[F, H, W, 3]` (leading singleton dims are dropped).
"""

from __future__ import annotations

import io

import numpy as np
import torch

AUDIO_FORMATS = ("wav", "flac", "pcm")  # pcm: raw little-endian 16-bit samples, no header
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
AUDIO_MIME = {"wav": "audio/wav", "flac": "audio/flac", "pcm": "audio/pcm"}
IMAGE_MIME = {"png": "image/png", "jpeg": "image/jpeg", "jpg": "image/jpeg", "webp": "image/webp"}


class MediaError(ValueError):
    """Bytes that do not decode as the image or audio they claim to be."""


def pcm16(audio: torch.Tensor) -> torch.Tensor:
    """Any audio output as flat int16 samples (float audio in [-1, 1] is scaled)."""
    flat = audio.reshape(-1)
    if flat.dtype == torch.int16:
        return flat
    return torch.floor(flat.float().clamp(-1, 1) * 32767 + 0.5).to(torch.int16)


def audio_bytes(audio: torch.Tensor, rate: int, fmt: str = "wav") -> bytes:
    """Mono 16-bit audio as a `fmt` file (`wav`, `flac`) or raw `pcm` samples."""
    samples = pcm16(audio).numpy()
    if fmt == "pcm":
        return samples.astype("<i2").tobytes()
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt.upper(), subtype="PCM_16")
    return buffer.getvalue()


def wav_bytes(audio: torch.Tensor, rate: int) -> bytes:
    """A mono 16-bit WAV file of `audio` (a zero-length one is still a valid WAV)."""
    return audio_bytes(audio, rate, "wav")


def streaming_wav_header(rate: int) -> bytes:
    """The header of a mono 16-bit WAV whose length is not known yet: soundfile's header for
    an empty file, its RIFF and data sizes set to the maximum, as streamed WAVs do."""
    header = bytearray(wav_bytes(torch.zeros(0, dtype=torch.int16), rate))
    header[4:8] = b"\xff\xff\xff\xff"
    header[-4:] = b"\xff\xff\xff\xff"  # the empty file ends with the data chunk's size
    return bytes(header)


def decode_audio(data: bytes) -> tuple[torch.Tensor, int]:
    """An audio file's samples (float32, mono: channels averaged) and its sample rate."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError) as err:
        raise MediaError(f"not an audio file soundfile can read: {err}") from err
    return torch.from_numpy(np.ascontiguousarray(samples.mean(axis=1))), int(rate)


def image_bytes(image: torch.Tensor, fmt: str = "png") -> bytes:
    """A uint8 `[..., H, W, 3]` image as a PNG, JPEG or WebP file."""
    from PIL import Image

    pixels = image.reshape(image.shape[-3:]).to(torch.uint8).contiguous().numpy()
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format=IMAGE_FORMATS[fmt])
    return buffer.getvalue()


def png_bytes(image: torch.Tensor) -> bytes:
    """A PNG of an [H, W, 3] uint8 image (leading singleton dims are dropped)."""
    return image_bytes(image, "png")


def decode_image(data: bytes) -> torch.Tensor:
    """An image file (any format Pillow reads) as a uint8 `[H, W, 3]` RGB tensor."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            rgb = image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise MediaError(f"not an image file Pillow can read: {err}") from err
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())


# --- video ---------------------------------------------------------------------------------

VIDEO_MIME = "video/mp4"
# x264's constant rate factor: 18 is visually lossless for most content (x264's default: 23).
VIDEO_CRF = 18


def mp4_bytes(frames: torch.Tensor, fps: int, crf: int = VIDEO_CRF) -> bytes:
    """uint8 frames `[..., F, H, W, 3]` as an H.264 (libx264, yuv420p) MP4 at `fps`, written
    with FFmpeg through PyAV. 4:2:0 chroma needs even sides: an odd side is padded by
    repeating its last row or column."""
    import av

    frames = frames.reshape(frames.shape[-4:]).to(torch.uint8)
    count, height, width, _ = frames.shape
    pad_h, pad_w = height % 2, width % 2
    if pad_h or pad_w:
        frames = torch.nn.functional.pad(
            frames.permute(0, 3, 1, 2).float(), (0, pad_w, 0, pad_h), mode="replicate"
        )
        frames = frames.permute(0, 2, 3, 1).to(torch.uint8)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=int(fps))
        stream.width, stream.height = width + pad_w, height + pad_h
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames.contiguous().numpy():
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def decode_video(data: bytes) -> tuple[torch.Tensor, float, str]:
    """An MP4 (any container PyAV reads) as uint8 frames `[F, H, W, 3]` (rgb24, as the peer's
    client decodes them), its average frame rate and its codec's name."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
            rate, codec = float(stream.average_rate), stream.codec_context.name
    except (av.error.FFmpegError, IndexError, ValueError) as err:
        raise MediaError(f"not a video file PyAV can read: {err}") from err
    return torch.from_numpy(np.stack(frames)), rate, codec

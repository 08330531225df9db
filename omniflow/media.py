"""Pipeline outputs as files people open, and files people send as pipeline inputs.

Audio is encoded and decoded with soundfile (libsndfile: WAV, FLAC) and PyAV (FFmpeg's
codecs: MP3 with LAME, Opus in Ogg, AAC in ADTS; it decodes whatever FFmpeg reads),
images with Pillow (PNG, JPEG, WebP), videos with FFmpeg through PyAV (H.264 in MP4). An
audio output is mono int16 or float samples in [-1, 1]; an image is a uint8 `[H, W, 3]`
tensor, a video uint8 frames `[F, H, W, 3]` (leading singleton dims are dropped).
`AudioEncoder` encodes audio as it arrives (a streamed reply) and `Tempo` changes its
speed without changing its pitch (FFmpeg's `atempo`), chunk by chunk too.

The decoders take limits (`max_seconds`, `max_pixels`) for files from people: what a
file's header declares (audio's length, channels and rate; an image's width x height; a
video's frames x width x height) is checked before anything is decoded, and decoding stops
at the same limit if the header lied, so a small file that declares a huge one (a
decompression bomb) costs milliseconds; audio decodes block by block into mono, a video
keeps only the frames asked for (`pick`).
"""

from __future__ import annotations

import contextlib
import fractions
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

# pcm: raw little-endian 16-bit samples, no header; mp3, opus, aac: PyAV's encoders.
AUDIO_FORMATS = ("wav", "flac", "pcm", "mp3", "opus", "aac")
IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG", "webp": "WEBP"}
AUDIO_MIME = {
    "wav": "audio/wav",
    "flac": "audio/flac",
    "pcm": "audio/pcm",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}
# Format -> (container, encoder, container options) of the formats PyAV encodes; the Ogg
# muxer writes a page every 20 ms of audio (its default, a second, would hold a stream back).
ENCODED_AUDIO = {
    "mp3": ("mp3", "libmp3lame", {}),
    "opus": ("ogg", "libopus", {"page_duration": "20000"}),
    "aac": ("adts", "aac", {}),
}
# The speeds `Tempo` makes (FFmpeg's atempo takes 0.5 .. 2 per pass; two passes reach these).
SPEEDS = (0.25, 4.0)
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
    """Mono 16-bit audio as a `fmt` file (`wav`, `flac`, `mp3`, `opus`, `aac`) or raw `pcm`
    samples."""
    samples = pcm16(audio).numpy()
    if fmt == "pcm":
        return samples.astype("<i2").tobytes()
    if fmt in ENCODED_AUDIO:
        encoder = AudioEncoder(fmt, rate)
        return encoder.feed(audio) + encoder.close()
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


def decode_audio(data: bytes, max_seconds: float | None = None) -> tuple[torch.Tensor, int]:
    """An audio file's samples (float32, mono: channels averaged) and its sample rate:
    WAV and FLAC through soundfile, anything else FFmpeg reads (MP3, Ogg, AAC, M4A, ...)
    through PyAV. With `max_seconds`, what the header declares (length, channels, rate) is
    checked before anything is decoded, and decoding stops past that length (a header that
    lies): a MediaError either way. Memory: the mono samples, and one block as it decodes."""
    import soundfile

    try:
        sound = soundfile.SoundFile(io.BytesIO(data))
    except (RuntimeError, soundfile.LibsndfileError, TypeError, ValueError):
        return _decode_with_av(data, max_seconds)
    with sound:
        rate, channels = int(sound.samplerate), int(sound.channels)
        _check_audio(sound.frames / rate if rate else 0.0, channels, rate, max_seconds)
        most = None if max_seconds is None else int(max_seconds * rate)
        parts, count = [], 0
        try:
            # `read` (not `blocks`, which leaves the unread tail of its last block as it was
            # allocated, uninitialized): what the file holds, however many frames its header
            # declares (an MP3's count is an estimate, a little over what it decodes).
            while len(block := sound.read(AUDIO_BLOCK // channels, "float32", always_2d=True)):
                parts.append(block.mean(axis=1))
                count += len(block)
                if most is not None and count > most:
                    raise MediaError(_too_long(count / rate, max_seconds))
        except (RuntimeError, soundfile.LibsndfileError) as err:
            raise MediaError(f"{NOT_AUDIO}: {err}") from err
    samples = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    return _playable(torch.from_numpy(np.ascontiguousarray(samples))), rate


def _playable(samples: torch.Tensor) -> torch.Tensor:
    """Decoded samples as they play: a float file can hold NaN or infinity, which no model
    should see (MediaError), and values past full scale (a float WAV's may reach 1e30,
    which overflows a mel spectrogram), which are clipped to [-1, 1] as a player clips
    them."""
    if not bool(torch.isfinite(samples).all()):
        raise MediaError("the audio holds samples that are NaN or infinite")
    return samples.clamp_(-1.0, 1.0)


NOT_AUDIO = "not an audio file (WAV, FLAC, MP3, Ogg, AAC, ... as FFmpeg reads them)"
# Samples (all channels) decoded at a time: what decoding holds beside the mono result.
AUDIO_BLOCK = 1 << 18
# The most channels and the rates a file may declare (7.1, telephony and studio rates pass).
MAX_CHANNELS = 16
MIN_RATE, MAX_RATE = 1000, 384000


def _check_audio(seconds: float, channels: int, rate: int, max_seconds: float | None) -> None:
    """What an audio header declares, checked before decoding: a MediaError if it is more
    than a clip of `max_seconds` may be."""
    if not 0 < channels <= MAX_CHANNELS:
        raise MediaError(f"{NOT_AUDIO}: it declares {channels} channels (at most {MAX_CHANNELS})")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise MediaError(
            f"{NOT_AUDIO}: it declares a rate of {rate} Hz ({MIN_RATE} to {MAX_RATE} are taken)"
        )
    if max_seconds is not None and seconds > max_seconds:
        raise MediaError(_too_long(seconds, max_seconds))


def _too_long(seconds: float, max_seconds: float) -> str:
    return f"the audio is {seconds:.1f} s long; at most {max_seconds:g} s is taken"


def _decode_with_av(data: bytes, max_seconds: float | None) -> tuple[torch.Tensor, int]:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise MediaError(f"{NOT_AUDIO}: it has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.sample_rate or 0)
            _check_audio(_declared_seconds(container, stream), stream.channels, rate, max_seconds)
            most = None if max_seconds is None else int(max_seconds * rate)
            mono = av.AudioResampler(format="flt", layout="mono", rate=rate)
            parts, count = [], 0
            for frame in container.decode(stream):
                for out in mono.resample(frame):
                    parts.append(out.to_ndarray().reshape(-1))
                    count += len(parts[-1])
                if most is not None and count > most:
                    raise MediaError(_too_long(count / rate, max_seconds))
            parts += [out.to_ndarray().reshape(-1) for out in mono.resample(None)]
    except MediaError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise MediaError(f"{NOT_AUDIO}: {reason}") from err
    if not parts or not rate:
        raise MediaError(f"{NOT_AUDIO}: it has no samples")
    return _playable(torch.from_numpy(np.concatenate(parts).astype(np.float32))), rate


def _declared_seconds(container, stream) -> float:
    """A stream's length as its container declares it (0 where it does not)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        import av

        return container.duration / av.time_base
    return 0.0


def resample(samples: torch.Tensor, rate: int, to: int) -> torch.Tensor:
    """Mono float32 samples at `rate` resampled to `to` (FFmpeg's resampler through PyAV);
    as they are when the rates agree."""
    if rate == to:
        return samples.float()
    import av

    frame = av.AudioFrame.from_ndarray(
        samples.float().numpy().reshape(1, -1), format="flt", layout="mono"
    )
    frame.sample_rate = rate
    resampler = av.AudioResampler(format="flt", layout="mono", rate=to)
    parts = [out.to_ndarray().reshape(-1) for out in resampler.resample(frame)]
    parts += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    if not parts:  # (too few samples to make one at the new rate)
        return torch.zeros(0)
    return torch.from_numpy(np.concatenate(parts).astype(np.float32))


class _Sink:
    """What a PyAV muxer writes into, taken as it comes (not seekable: a muxer that would
    seek back to patch a header writes it up front instead)."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def seekable(self) -> bool:
        return False

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class AudioEncoder:
    """Mono audio at `rate` as an `fmt` stream (`mp3`, `opus`, `aac`: PyAV's encoders;
    `wav`: a header whose sizes are unknown, then the samples; `pcm`: the samples): `feed`
    returns the bytes of what the encoder could finish so far, `close` the rest. The
    concatenation of every call's bytes is one valid file."""

    def __init__(self, fmt: str, rate: int):
        self.format, self.rate = fmt, rate
        self.started = False
        self.container = None
        if fmt in ENCODED_AUDIO:
            import av

            container, codec, options = ENCODED_AUDIO[fmt]
            self.sink = _Sink()
            self.container = av.open(self.sink, mode="w", format=container, options=options)
            self.stream = self.container.add_stream(codec, rate=rate, layout="mono")
            self.pts = 0
        elif fmt not in ("wav", "pcm"):
            raise MediaError(f"no streamed encoding of {fmt!r}")

    def feed(self, audio: torch.Tensor) -> bytes:
        samples = pcm16(audio).numpy().astype("<i2")
        head = b""
        if self.format == "wav" and not self.started:
            head = streaming_wav_header(self.rate)
        self.started = True
        if self.container is None:
            return head + samples.tobytes()
        if not len(samples):
            return b""
        import av

        frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
        frame.sample_rate, frame.pts = self.rate, self.pts
        frame.time_base = fractions.Fraction(1, self.rate)
        self.pts += len(samples)
        for packet in self.stream.encode(frame):
            self.container.mux(packet)
        return self.sink.take()

    def close(self) -> bytes:
        """The rest of the stream (a stream that was fed nothing is a valid empty file)."""
        if self.container is None:
            return b"" if self.started or self.format == "pcm" else streaming_wav_header(self.rate)
        for packet in self.stream.encode(None):
            self.container.mux(packet)
        self.container.close()
        self.container = None
        return self.sink.take()


class Tempo:
    """Mono int16 audio at `rate` played `speed` times as fast, its pitch kept (FFmpeg's
    `atempo`, two passes beyond 0.5 .. 2), chunk by chunk: `feed` returns what is ready
    (a few ms behind its input), `close` the rest."""

    def __init__(self, speed: float, rate: int):
        from av.filter import Graph

        if not SPEEDS[0] <= speed <= SPEEDS[1]:
            raise MediaError(f"speed {speed:g} is outside {SPEEDS[0]:g} .. {SPEEDS[1]:g}")
        self.rate, self.pts = rate, 0
        self.graph = Graph()
        node = self.graph.add_abuffer(
            format="s16", sample_rate=rate, layout="mono", time_base=f"1/{rate}"
        )
        for factor in _tempo_passes(speed):
            step = self.graph.add("atempo", f"{factor:.6f}")
            node.link_to(step)
            node = step
        node.link_to(self.graph.add("abuffersink"))
        self.graph.configure()

    def feed(self, audio: torch.Tensor) -> torch.Tensor:
        import av

        samples = pcm16(audio).numpy()
        if len(samples):
            frame = av.AudioFrame.from_ndarray(samples[None], format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.pts
            frame.time_base = fractions.Fraction(1, self.rate)
            self.pts += len(samples)
            self.graph.push(frame)
        return self._pull()

    def close(self) -> torch.Tensor:
        self.graph.push(None)
        return self._pull()

    def _pull(self) -> torch.Tensor:
        import av

        parts = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                break
            parts.append(frame.to_ndarray().reshape(-1))
        if not parts:
            return torch.zeros(0, dtype=torch.int16)
        return torch.from_numpy(np.concatenate(parts).astype(np.int16))


def _tempo_passes(speed: float) -> list[float]:
    """atempo factors (each in 0.5 .. 2) whose product is `speed`."""
    if 0.5 <= speed <= 2.0:
        return [speed]
    root = speed**0.5
    return [root, root]


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


def decode_image(data: bytes, max_pixels: int | None = None) -> torch.Tensor:
    """An image file (any format Pillow reads) as a uint8 `[H, W, 3]` RGB tensor. Its
    declared size is checked against `max_pixels` before its pixels are decoded (Pillow
    reads the header alone until `convert`): a MediaError, as is any file Pillow refuses
    (its own decompression-bomb limit included)."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow warns of large images as it opens them; the size is checked here.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if max_pixels is not None and width * height > max_pixels:
                    raise MediaError(_too_many_pixels(f"{width}x{height}", max_pixels))
                rgb = image.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError as err:  # over twice Pillow's own limit
        what = f"over {2 * Image.MAX_IMAGE_PIXELS}"
        raise MediaError(_too_many_pixels(what, max_pixels or Image.MAX_IMAGE_PIXELS)) from err
    except UnidentifiedImageError as err:  # (its message names the buffer object)
        raise MediaError("not an image file Pillow can read: no format it knows") from err
    except (OSError, ValueError) as err:
        raise MediaError(f"not an image file Pillow can read: {err}") from err
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy())


def _too_many_pixels(size: str, max_pixels: int) -> str:
    return f"the image is {size} pixels; at most {max_pixels} pixels are taken"


# --- video ---------------------------------------------------------------------------------

VIDEO_MIME = "video/mp4"
# x264's constant rate factor: 18 is visually lossless for most content (x264's default: 23).
VIDEO_CRF = 18


def mp4_bytes(
    frames: torch.Tensor,
    fps: int,
    crf: int = VIDEO_CRF,
    on_frame: Callable[[int, int], None] | None = None,
) -> bytes:
    """uint8 frames `[..., F, H, W, 3]` as an H.264 (libx264, yuv420p) MP4 at `fps`, written
    with FFmpeg through PyAV. 4:2:0 chroma needs even sides: an odd side is padded by
    repeating its last row or column. `on_frame(done, total)` hears of each frame as its
    encoded packet is written (a long video's encode reports its progress)."""
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
        muxed = 0

        def mux(packets) -> None:
            nonlocal muxed
            for packet in packets:  # one a frame, as the encoder finishes it (it buffers)
                container.mux(packet)
                muxed += 1
                if on_frame is not None:
                    on_frame(min(muxed, count), count)

        for frame in frames.contiguous().numpy():
            mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        mux(stream.encode())
    return buffer.getvalue()


@dataclass(frozen=True)
class VideoInfo:
    """What a video file's header declares: frames (0 where the container does not say),
    width, height, average frame rate, and its codec's name."""

    frames: int
    width: int
    height: int
    rate: float
    codec: str

    @property
    def pixels(self) -> int:
        return self.frames * self.width * self.height


def probe_video(data: bytes, max_pixels: int | None = None) -> VideoInfo:
    """A video file checked without keeping its frames: a MediaError if it is not a video,
    declares more than `max_pixels` (frames x width x height; checked before decoding) or
    an empty picture, or does not decode to the end (decoding stops at the limit too, if
    the header lied). Its info, with the frames it really has."""
    import av

    with _not_video_errors():
        with av.open(io.BytesIO(data)) as container:
            info = _video_info(container)
        if info.width * info.height <= 0:
            raise MediaError(f"{NOT_VIDEO}: it declares a {info.width}x{info.height} picture")
        _check_video_pixels(info.pixels, max_pixels)
        frames = _has_frames(_decode_frames(data, max_pixels, set())[1])
    return VideoInfo(frames, info.width, info.height, info.rate, info.codec)


def video_header(data: bytes) -> VideoInfo:
    """What a video file's header declares (its frames too: 0 where it does not say),
    nothing decoded."""
    import av

    with _not_video_errors(), av.open(io.BytesIO(data)) as container:
        return _video_info(container)


@contextlib.contextmanager
def _not_video_errors():
    """What PyAV raises on a file that is not a readable video, as a MediaError."""
    import av

    try:
        yield
    except MediaError:  # a ValueError too, already saying what is wrong
        raise
    except (av.error.FFmpegError, IndexError, ValueError) as err:
        raise MediaError(f"{NOT_VIDEO}: {err}") from err


def _has_frames(frames):
    if not frames:
        raise MediaError(f"{NOT_VIDEO}: it has no frames")
    return frames


def decode_video(
    data: bytes,
    max_pixels: int | None = None,
    pick: Callable[[int, float], Sequence[int]] | None = None,
) -> tuple[torch.Tensor, float, str]:
    """An MP4 (any container PyAV reads) as uint8 frames `[F, H, W, 3]` (rgb24, as the peer's
    client decodes them), its average frame rate and its codec's name. Decoding stops with a
    MediaError once it has decoded more than `max_pixels` (frames x width x height; the
    declared count is checked first). `pick(total, rate)` names the frames to keep of
    `total` (all when None): only those are converted and held; `total` is the count the
    container declares, and a file whose declared count proves wrong is decoded again with
    the true one."""
    import av

    with _not_video_errors():
        with av.open(io.BytesIO(data)) as container:
            info = _video_info(container)
            _check_video_pixels(info.pixels, max_pixels)
        if pick is None:
            frames, _ = _decode_frames(data, max_pixels, None)
        else:
            total = info.frames or _decode_frames(data, max_pixels, set())[1]
            while True:
                frames, decoded = _decode_frames(data, max_pixels, set(pick(total, info.rate)))
                if decoded == total:
                    break
                total = decoded
    return torch.from_numpy(np.stack(_has_frames(frames))), info.rate, info.codec


NOT_VIDEO = "not a video file PyAV can read"


def _video_info(container) -> VideoInfo:
    if not container.streams.video:
        raise MediaError(f"{NOT_VIDEO}: it has no video stream")
    stream = container.streams.video[0]
    rate = float(stream.average_rate or 0)
    frames = int(stream.frames or 0) or round(_declared_seconds(container, stream) * rate)
    context = stream.codec_context
    return VideoInfo(frames, int(context.width), int(context.height), rate, context.name)


def _check_video_pixels(pixels: int, max_pixels: int | None) -> None:
    if max_pixels is not None and pixels > max_pixels:
        raise MediaError(
            f"the video is {pixels} pixels (frames x width x height); at most {max_pixels} "
            "are taken"
        )


def _decode_frames(data: bytes, max_pixels: int | None, keep: set[int] | None):
    """The frames whose indices are in `keep` (every frame when None) as rgb24 arrays, and
    how many frames the file has."""
    import av

    frames, decoded, pixels = [], 0, 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(video=0):
            pixels += frame.width * frame.height
            _check_video_pixels(pixels, max_pixels)
            if keep is None or decoded in keep:
                frames.append(frame.to_ndarray(format="rgb24"))
            decoded += 1
    return frames, decoded

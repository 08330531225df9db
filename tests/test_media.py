"""omniflow.media's audio decoding: what a file holds, sample for sample."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile
import torch

from omniflow.media import MediaError, audio_bytes, decode_audio


def test_an_mp3_decodes_to_the_samples_it_holds_not_its_headers_estimate():
    """libsndfile estimates an MP3's length from its header (a few hundred samples over
    what it decodes): the decode is what one whole read of the file gives, every sample
    finite, the same each time, never a tail of whatever memory held before."""
    t = np.arange(36000) / 24000
    clip = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    data = audio_bytes(torch.from_numpy(clip), 24000, "mp3")
    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        held = sound.read(dtype="float32")
    decodes = [decode_audio(data) for _ in range(3)]
    for samples, rate in decodes:
        assert rate == 24000
        assert np.array_equal(samples.numpy(), held)


def test_a_float_file_holding_nan_or_infinity_is_refused():
    for bad in (np.nan, np.inf):
        clip = np.zeros(2400, np.float32)
        clip[1000] = bad
        buffer = io.BytesIO()
        soundfile.write(buffer, clip, 24000, format="WAV", subtype="FLOAT")
        with pytest.raises(MediaError, match="NaN or infinite"):
            decode_audio(buffer.getvalue())

"""The neural audio codecs transformers ships (`model_type` dac, mimi, encodec), as vocoders:
their decoders turn codec frames into a waveform. A single-part checkpoint of one, or the
codec part of a multi-part speech model, is sized and run as a vocoder.

Run-time half: `codecs` (each codec's `Decoder` for the transformers `vocoder` backend,
with its decoder's receptive field walked layer by layer).
"""

from __future__ import annotations

from omniflow.families.family import Family

FAMILY = Family(
    name="audio_codecs",
    doc=__doc__,
    architectures=("dac", "mimi", "encodec"),
    whole="vocoder",
    runtime={("vocoder", "transformers"): f"{__name__}.codecs:load"},
)

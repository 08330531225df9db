"""The voices a speech pipeline speaks with: its models' named speakers, and voices uploaded
to the server (`POST /v1/audio/voices`), each a reference clip encoded once into the voice
prompt its model clones from.

A stage whose model family encodes voices (`Family.voices`, in the plan as
`FamilyCode.voices`) gets a `VoiceEncoder`, loaded on first use from the stage's own
checkpoint (on the stage's device where this process can reach it, else the CPU). It turns
a clip into the values of the stage's input ports (Qwen3-TTS: `ref_audio` the x-vector and
codes as one text, `ref_text` the transcript); the server maps those ports to the pipeline
inputs that feed them. A request naming an uploaded voice gets those values as they were
stored, so nothing is encoded again; a request with inline `ref_audio` is encoded the same
way before admission. The store is bounded (`--max-voices`, a clip's length); an upload
beyond it is a 400, never an eviction.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from dataclasses import dataclass, field

import torch

from omniflow.errors import OmniflowError
from omniflow.plan import StagePlan
from omniflow.runtime.python_backend import import_function
from omniflow.server.errors import bad_request

log = logging.getLogger("omniflow.server")
MAX_VOICES = 64
MAX_CLIP_SECONDS = 60.0
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # matched whole (no "bob\n")


@dataclass
class UploadedVoice:
    """A voice uploaded to a pipeline: `inputs` are the pipeline inputs a request naming it
    gets (the encoded prompt among them)."""

    name: str
    pipeline: str
    inputs: dict[str, str]
    ref_text: str
    seconds: float
    created: int = field(default_factory=lambda: int(time.time()))

    def entry(self) -> dict:
        return {
            "name": self.name,
            "type": "uploaded",
            "model": self.pipeline,
            "ref_text": self.ref_text,
            "audio_seconds": round(self.seconds, 3),
            "created": self.created,
        }


class Encoder:
    """One stage's voice encoder (its family's), loaded on first use: a clip -> the
    pipeline inputs that carry it to the stage."""

    def __init__(self, served, stage: StagePlan, factory: str):
        self.served = served
        self.stage = stage
        self.factory = factory
        self.lock = threading.Lock()
        self.loaded = False
        self.model = None
        self.count = 0  # clips encoded
        inputs = {p.name for p in served.plan.inputs}
        self.feeds = {
            c.dst_port: c.src
            for c in served.plan.channels
            if c.dst == stage.name and c.src in inputs
        }

    def _load(self):
        with self.lock:
            if not self.loaded:
                from omniflow.runtime.preflight import locate_model

                try:
                    path = locate_model(self.stage.model)
                    self.model = import_function(self.factory)(path, _device(self.stage))
                except OmniflowError as err:  # no model here (stand-ins), or no encoder in it
                    log.warning("stage %s encodes no voices: %s", self.stage.name, err)
                    self.model = None
                self.loaded = True
        return self.model

    async def available(self) -> bool:
        """Whether the stage's model clones voices (loading the encoder, the first time, in
        a thread: the server goes on serving meanwhile)."""
        return await asyncio.to_thread(self._load) is not None

    def encode(self, samples: torch.Tensor, rate: int, ref_text: str) -> dict[str, str]:
        """The pipeline inputs of a clone of `samples` (mono float at `rate`): what the
        stage's ports take, under the names of the inputs that feed them."""
        model = self._load()
        values = model.encode(samples, rate, ref_text)
        self.count += 1
        self.served.metrics.voice_encodes.labels(self.served.name).inc()
        missing = [port for port in values if port not in self.feeds]
        if missing:
            raise OmniflowError(
                f"pipeline '{self.served.name}' has no input into {self.stage.name}."
                f"{', '.join(missing)}, where its voices go"
            )
        return {self.feeds[port]: value for port, value in values.items()}


def encoders_of(served) -> list[Encoder]:
    """The voice encoders of a pipeline's stages (where their families have one) that
    pipeline inputs feed: where a request's voice can go."""
    encoders = [
        Encoder(served, stage, stage.family.voices)
        for stage in served.plan.stages
        if stage.family is not None and stage.family.voices and stage.model
    ]
    return [e for e in encoders if e.feeds]


def _device(stage: StagePlan) -> str:
    device = stage.devices[0] if stage.devices else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "cpu"
    return device if device.startswith(("cuda", "cpu")) else "cpu"


class VoiceStore:
    """Uploaded voices by (pipeline, name), at most `limit` in all."""

    def __init__(self, limit: int = MAX_VOICES, max_seconds: float = MAX_CLIP_SECONDS):
        self.limit = limit
        self.max_seconds = max_seconds
        self.voices: dict[tuple[str, str], UploadedVoice] = {}

    def get(self, pipeline: str, name: str) -> UploadedVoice | None:
        return self.voices.get((pipeline, name.lower()))

    def of(self, pipeline: str) -> list[UploadedVoice]:
        return [v for (p, _), v in self.voices.items() if p == pipeline]

    def add(self, voice: UploadedVoice) -> None:
        key = (voice.pipeline, voice.name.lower())
        if key in self.voices:
            raise bad_request(
                f"'name': pipeline '{voice.pipeline}' has a voice '{voice.name}' already; "
                f"DELETE /v1/audio/voices/{voice.name} first",
                param="name",
                code="voice_exists",
            )
        if len(self.voices) >= self.limit:
            raise bad_request(
                f"this server keeps at most {self.limit} uploaded voices and has as many; "
                "DELETE one first (or start it with a larger --max-voices)",
                param="name",
                code="voice_store_full",
            )
        self.voices[key] = voice

    def remove(self, pipeline: str, name: str) -> UploadedVoice | None:
        return self.voices.pop((pipeline, name.lower()), None)


def check_name(name) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(
            "'name' must be 1 to 64 letters, digits, '_', '-' or '.', starting with a letter "
            "or digit",
            param="name",
        )
    return name


async def encode(encoder: Encoder, samples: torch.Tensor, rate: int, ref_text: str, where: str):
    """`encoder.encode` off the event loop; a clip the model cannot take is a 400 at
    `where`."""
    try:
        return await asyncio.to_thread(encoder.encode, samples, rate, ref_text)
    except OmniflowError as err:
        raise bad_request(f"'{where}': {err}", param=where) from None

"""The voices a speech pipeline speaks with: its models' named speakers, and voices uploaded
to the server (`POST /v1/audio/voices`), each a reference clip encoded once into the voice
prompt its model clones from.

The encoding runs in the plan, never here: a pipeline that clones voices has a
`voice_prompt` output, made by a stage of its own (Qwen3-TTS: `voice_encoder`, an encoder
stage beside the talker) from the one input that feeds it (`ref_audio`). An upload is a
request for that output alone (`VoiceEntry`: the engine runs only the stages it depends
on), so the API process loads no model and touches no GPU; whether the pipeline clones at
all is its stages' families' torch-free answer (`Family.voices`). The prompt is kept with
the transcript as the pipeline inputs a request naming the voice gets: sent back on that
same input, it passes the encoder stage as it is, and nothing is encoded again. An inline
`ref_audio` goes to the pipeline as the clip itself and is encoded by the same stage. The
store is bounded (`--max-voices`, a clip's length); an upload beyond it is a 400, never an
eviction.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

from omniflow.errors import OmniflowError
from omniflow.runtime.python_backend import import_function
from omniflow.runtime.requests import RequestError, RequestFailed
from omniflow.runtime.transport import EngineError
from omniflow.server.errors import APIError, bad_request

log = logging.getLogger("omniflow.server")
MAX_VOICES = 64
MAX_CLIP_SECONDS = 60.0
# The plan's output a voice upload asks for alone, and the input its transcript goes on.
VOICE_OUTPUT = "voice_prompt"
TRANSCRIPT = "ref_text"
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


class VoiceEntry:
    """A pipeline's plan-level "encode a voice" entry: its `voice_prompt` output. A request
    for that output alone runs only the stages it depends on (the voice encoder stage, in
    an executor: placed, budgeted, profiled and restarted like any stage) with only the
    input that feeds them, the clip; what comes out is the voice prompt, which a request
    naming the voice sends back on that input (the stage passes a prompt on as it is)."""

    def __init__(self, served):
        plan = served.plan
        self.served = served
        self.scope = plan.upstream(frozenset({VOICE_OUTPUT}))
        names = {p.name for p in plan.inputs}
        fed = sorted({c.src for c in plan.channels if c.dst in self.scope and c.src in names})
        self.input = fed[0] if len(fed) == 1 else None  # where the clip goes
        self.transcript = TRANSCRIPT if TRANSCRIPT in names else None
        self.clones: bool | None = None  # asked of the stages' families on first use

    async def available(self) -> bool:
        """Whether the pipeline clones voices (`clones_voices`), off the event loop."""
        if self.clones is None:
            self.clones = await asyncio.to_thread(self.clones_voices)
        return self.clones

    def clones_voices(self) -> bool:
        """Whether the pipeline clones voices: a stage of the entry runs a checkpoint its
        family says clones them (`Family.voices`: torch-free; no model loads here)."""
        from omniflow.runtime.preflight import locate_model

        for stage in self.served.plan.stages:
            family = stage.family
            if stage.name not in self.scope or family is None or not family.voices:
                continue
            try:
                if import_function(family.voices)(locate_model(stage.model)):
                    return True
            except OmniflowError as err:  # no model here (stand-ins)
                log.warning("stage %s encodes no voices: %s", stage.name, err)
        return False

    async def encode(self, clip: str, ref_text: str, where: str) -> dict[str, str]:
        """The pipeline inputs of a clone of `clip` (the input's value: a `data:` URI of an
        audio file): the voice prompt the plan's voice encoder made of it, on the input
        that carries it, and the transcript. Admission's refusal is a 400 at `where`; a
        failed stage or a dead executor fails this upload alone (500)."""
        engine = self.served.engine
        try:
            admitted = engine.admit({self.input: clip}, None, frozenset({VOICE_OUTPUT}))
        except RequestError as err:
            raise bad_request(f"'{where}': {err}", param=where) from None
        prompt = []
        try:
            async for chunk in engine.stream(admitted):
                if chunk.value is not None:
                    prompt.append(chunk.value)
        except RequestFailed as err:
            raise APIError(
                500, f"encoding the voice failed: {err}", code="pipeline_failed"
            ) from None
        except EngineError as err:
            raise APIError(
                503, f"the pipeline is not running: {err}", code="engine_closed"
            ) from None
        if not prompt:
            raise APIError(500, "the voice encoder sent no voice prompt", code="pipeline_failed")
        self.served.metrics.voice_encodes.labels(self.served.name).inc()
        inputs = {self.input: "".join(prompt)}
        if self.transcript is not None:
            inputs[self.transcript] = ref_text
        return inputs


def voice_entry(served) -> VoiceEntry | None:
    """The pipeline's voice entry, where it has a `voice_prompt` output that one pipeline
    input feeds."""
    if VOICE_OUTPUT not in {o.name for o in served.plan.outputs}:
        return None
    entry = VoiceEntry(served)
    return entry if entry.input is not None else None


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

    def check_room(self, pipeline: str, name: str) -> None:
        """A 400 naming `name` if the store could not keep a voice of that name for
        `pipeline`: asked before its clip is encoded, and again as it is kept (another
        upload of the name may have been kept while this one encoded)."""
        if (pipeline, name.lower()) in self.voices:
            raise bad_request(
                f"'name': pipeline '{pipeline}' has a voice '{name}' already; "
                f"DELETE /v1/audio/voices/{name} first",
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

    def add(self, voice: UploadedVoice) -> None:
        self.check_room(voice.pipeline, voice.name)
        self.voices[(voice.pipeline, voice.name.lower())] = voice

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

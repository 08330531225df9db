"""The talker stage: Qwen3-TTS's talker and code predictor as a component of the
transformers `ar` backend (`omniflow.backends.transformers_ar`).

Each request's prefill is its task's prompt (`prompt.build`); each step samples codebook 0
from the talker's `codec_head`, then the code predictor fills codebooks 1..15 for every row
of the step at once (`frames`), and the frame goes out on `codes` as int64 `[1, 16]`; the
next step feeds the talker the sum of the frame's 16 codebook embeddings plus that step's
text-side row. End-of-speech (codec eos) ends the request and emits no frame. A voice
clone with reference codes (ICL) first sends the reference's frames, every code offset
by the codebook size (2048), with its first frame: code2wav decodes them as context only
(`code2wav.Code2Wav.context_frames`), as the reference decodes reference and new codes
together and cuts the reference's audio.

Sampling is `Qwen3TTSForConditionalGeneration.generate`'s: the checkpoint's
generation_config.json (temperature 0.9, top-k 50, top-p 1, repetition penalty 1.05 over
the codebook-0 ids generated so far), every special id but end-of-speech suppressed
(the top 1024 of the 3072), end-of-speech masked for the first two steps
(`min_new_tokens=2`). The code predictor samples with the sub-talker's settings
(`subtalker_*`) from the request's own generator, right after the talker's draw; a
greedy request (temperature 0) is greedy in both.

Request inputs (ports) and parameters:

- `prompt` (text): what to say.
- `voice` (text): a CustomVoice speaker (case-insensitive; the stage's `speaker` parameter
  where no voice input is connected; empty: none, the reference's instruction-made
  speaker); given audio, it is the reference audio of a voice clone.
- `instructions` (text): CustomVoice's style instruction (1.7B only) or VoiceDesign's voice
  description; empty: none.
- `ref_audio` (text: a file path, a `data:` URI or base64 of a WAV/FLAC file; or audio:
  float samples at 24 kHz) and `ref_text` (text): a Base checkpoint's voice clone.
- parameters `language` (Auto, Chinese, English, ... as the config lists them),
  `task_type` (CustomVoice, VoiceDesign or Base: must be the checkpoint's own; empty: it),
  `x_vector_only_mode` (clone from the speaker embedding alone; else ICL, which needs
  `ref_text`), `non_streaming_mode` (where the text goes: unset, the reference's default,
  true for CustomVoice and VoiceDesign, false for voice clones).
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass

import torch

from omniflow.backends.checkpoint_files import read_json
from omniflow.backends.sampling_params import Sampling
from omniflow.backends.transformers_ar import (
    ARBackendError,
    Component,
    Prompt,
    Sequence,
    sample_sub_step,
    sub_sampling,
)
from omniflow.families.qwen3_tts import prompt as prompts
from omniflow.families.qwen3_tts.config import (
    CONFIG,
    GENERATION_CONFIG,
    SAMPLING_DEFAULTS,
    Qwen3TTSError,
    TTSConfig,
)
from omniflow.families.qwen3_tts.modeling import (
    Talker,
    load_speaker_encoder,
    load_talker,
    resample,
    speaker_embedding,
)
from omniflow.runtime.stage import Call

_STATE = "qwen3_tts"
SAMPLE_RATE = 24000
# EOS is masked while fewer codes than this were generated (`generate`'s min_new_tokens).
MIN_NEW_TOKENS = 2


def load(path: str, component: str | None, device: str, dtype) -> QwenTTSTalker:
    from transformers import AutoTokenizer

    if component not in (None, "talker"):
        raise ARBackendError(
            f"Qwen3-TTS has no '{component}' language model; use component=\"talker\" "
            "(code2wav runs on a vocoder stage)"
        )
    raw = read_json(path, CONFIG)
    if raw is None:
        raise ARBackendError(f"{path} has no {CONFIG}")
    try:
        config = TTSConfig.of(raw)
        talker = load_talker(path, config, dtype, device)
        encoders = None
        if config.task == "Base":
            from omniflow.families.qwen3_tts.speech_tokenizer import load_encoder

            encoders = (
                load_speaker_encoder(path, config, dtype, device),
                load_encoder(path, device),
            )
    except Qwen3TTSError as err:
        raise ARBackendError(str(err)) from err
    tokenizer = AutoTokenizer.from_pretrained(path)
    generation = {**SAMPLING_DEFAULTS, **(read_json(path, GENERATION_CONFIG) or {})}
    return QwenTTSTalker(talker, tokenizer, config, generation, encoders)


@dataclass
class _Request:
    """A running request's text side and the input of its next step."""

    trailing: torch.Tensor  # [T, D]
    pad: torch.Tensor  # [D]
    next: torch.Tensor | None = None  # [D]: the last frame's codebook embeddings, summed
    context: torch.Tensor | None = None  # an ICL clone's reference frames, not yet sent

    def text_side(self, step: int) -> torch.Tensor:
        return self.trailing[step] if step < len(self.trailing) else self.pad


class QwenTTSTalker(Component):
    inputs = {
        "prompt": ("text",),
        "voice": ("text", "audio"),
        "instructions": ("text",),
        "ref_audio": ("text", "audio"),
        "ref_text": ("text",),
    }
    required = frozenset({"prompt"})
    outputs = frozenset({"codes", "tokens"})

    def __init__(self, talker: Talker, tokenizer, config: TTSConfig, generation: dict, encoders):
        self.model = talker
        self.decoder = talker.model
        self.head = talker.codec_head
        self.embed = talker.codec_embedding
        self.tokenizer = tokenizer
        self.config = config
        self.layout = config.layout
        self.eos_ids = frozenset({self.layout.codec_eos})
        self.suppress = self.layout.suppressed
        self.generation = generation
        self.defaults = {
            "temperature": float(generation["temperature"]) if generation["do_sample"] else 0.0,
            "top_k": int(generation["top_k"]),
            "top_p": float(generation["top_p"]),
            "repetition_penalty": float(generation["repetition_penalty"]),
        }
        # How the code predictor samples when the talker does (None: greedily).
        self.sub_sampling = None
        if generation["subtalker_dosample"]:
            self.sub_sampling = sub_sampling(
                generation["subtalker_temperature"],
                generation["subtalker_top_k"],
                generation["subtalker_top_p"],
            )
        self.encoders = encoders  # Base: (speaker encoder, speech tokenizer encoder)
        self.codebook_size = talker.code_predictor.lm_head[0].out_features

    # --- prompts ----------------------------------------------------------------------------
    def can_start(self, call: Call) -> bool:
        return all(stream.ended for stream in call.inputs.values())

    def _text(self, call: Call, port: str) -> str:
        stream = call.inputs.get(port)
        value = stream.take() if stream is not None else None
        return value if isinstance(value, str) else ""

    def request(self, call: Call) -> prompts.TTSRequest:
        """The request's task inputs, checked against this checkpoint."""
        params = call.params or {}
        task = params.get("task_type") or self.config.task
        if task != self.config.task:
            raise ARBackendError(
                f"task_type {task!r}: this checkpoint ({self.config.task}) does only {self.config.task}"
            )
        text = self._text(call, "prompt")
        if not text:
            raise ARBackendError("the text to speak is empty")
        voice = call.inputs["voice"].take() if "voice" in call.inputs else params.get("speaker")
        ref_audio = call.inputs["ref_audio"].take() if "ref_audio" in call.inputs else None
        if isinstance(voice, torch.Tensor):
            voice, ref_audio = None, voice if ref_audio is None or ref_audio == "" else ref_audio
        request = prompts.TTSRequest(
            text,
            task,
            language=params.get("language") or "auto",
            instructions=self._text(call, "instructions"),
            ref_text=self._text(call, "ref_text"),
            non_streaming=params.get("non_streaming_mode"),
        )
        has_audio = isinstance(ref_audio, torch.Tensor) or bool(ref_audio)
        if task == "CustomVoice":
            if voice:
                if voice.lower() not in self.layout.speakers:
                    names = ", ".join(sorted(self.layout.speakers))
                    raise ARBackendError(f"unknown voice {voice!r}; this model has {names}")
                request.speaker = voice
            if request.instructions and self.config.size == "0b6":
                raise ARBackendError("the 0.6B CustomVoice model takes no instructions")
        elif voice:
            raise ARBackendError(
                f"a {task} model has no named voices (got {voice!r})"
                + (
                    "; describe the voice in `instructions`"
                    if task == "VoiceDesign"
                    else "; give ref_audio"
                )
            )
        if task == "Base":
            if not has_audio:
                raise ARBackendError("voice cloning (Base) needs ref_audio")
            self._clone(request, ref_audio, bool(params.get("x_vector_only_mode")))
        elif has_audio:
            raise ARBackendError(f"a {task} model does not clone voices (ref_audio given)")
        if task == "Base" and request.instructions:
            raise ARBackendError("voice cloning (Base) takes no instructions")
        prompts.language_id(self.layout, request.language, request.speaker)  # checked early
        return request

    def _clone(self, request: prompts.TTSRequest, ref_audio, x_vector_only: bool) -> None:
        audio = reference_audio(ref_audio)
        speaker, tokenizer = self.encoders
        request.x_vector = speaker_embedding(speaker, audio)
        if x_vector_only:
            return
        if not request.ref_text:
            raise ARBackendError(
                "voice cloning with the reference's codes (ICL) needs ref_text; "
                "or set x_vector_only_mode"
            )
        request.ref_codes = tokenizer.encode(audio)

    def prompt(self, call: Call) -> Prompt:
        try:
            request = self.request(call)
            with torch.inference_mode():
                built = prompts.build(self.model, self.tokenizer, self.layout, request)
        except Qwen3TTSError as err:
            raise ARBackendError(str(err)) from err
        context = None
        if request.ref_codes is not None:  # sent ahead of the first frame, marked
            context = request.ref_codes.cpu() + self.codebook_size
        call.state[_STATE] = _Request(built.trailing, built.pad, context=context)
        return Prompt(built.embeds, [])

    # --- steps ------------------------------------------------------------------------------
    def mask_logits(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        for row, seq in enumerate(seqs):
            if seq.generated < MIN_NEW_TOKENS:
                logits[row, self.layout.codec_eos] = -float("inf")

    def frames(self, seqs: list[Sequence], ids: list[int], hidden: torch.Tensor):
        """Complete every row's frame with the code predictor, all rows in each of its
        sub-steps, with one read-back for the batch; None for the end of speech."""
        rows = [i for i, token in enumerate(ids) if token not in self.eos_ids]
        out: list[torch.Tensor | None] = [None] * len(ids)
        if not rows:
            return out
        first = torch.tensor([ids[i] for i in rows], device=hidden.device)
        sub = [seqs[i] for i in rows]
        codes = predict_codes(self.model, hidden[rows], first, sub, self.sub_sampling)
        sums = self.model.frame_embeds(codes)
        host = codes.cpu()
        for j, (i, seq) in enumerate(zip(rows, sub, strict=True)):
            state = seq.call.state[_STATE]
            state.next = sums[j]
            out[i] = host[j : j + 1]
            if state.context is not None:
                out[i], state.context = torch.cat([state.context, out[i]]), None
        return out

    def step_embeds(self, seqs: list[Sequence]) -> torch.Tensor:
        rows = []
        for seq in seqs:
            state = seq.call.state[_STATE]
            rows.append(state.next + state.text_side(seq.generated - 1))
        return torch.stack(rows)


@torch.inference_mode()
def predict_codes(
    talker: Talker,
    hidden: torch.Tensor,
    first: torch.Tensor,
    seqs: list[Sequence] | None = None,
    sampling: Sampling | None = None,
) -> torch.Tensor:
    """Codebooks `[n, G]` of n frames: `first` (codebook 0) and what the code predictor
    gives for 1..G-1 from each row's talker hidden state `[n, D]`, sub-step by sub-step,
    all rows in each forward (their positions agree: no padding). Greedy without `seqs`;
    else each row as its request samples (`sample_sub_step`: greedy requests greedily,
    the others with `sampling`, from their own generators)."""
    from transformers import DynamicCache

    predictor = talker.code_predictor
    cache = DynamicCache(config=predictor.model.config)
    embeds = torch.stack([hidden, talker.codec_embedding(first)], dim=1)
    h = predictor.forward_step(embeds, cache, 0)[:, -1]
    codes = [first]
    for g in range(1, talker.groups):
        logits = predictor.lm_head[g - 1](h).float()
        code = logits.argmax(-1) if seqs is None else sample_sub_step(logits, seqs, sampling, g)
        codes.append(code)
        if g < talker.groups - 1:
            step = predictor.model.codec_embedding[g - 1](code)[:, None]
            h = predictor.forward_step(step, cache, g + 1)[:, -1]
    return torch.stack(codes, dim=1)


def reference_audio(value) -> torch.Tensor:
    """A voice clone's reference audio as 24 kHz mono float32 samples: a tensor is taken as
    24 kHz samples; a string is a file path, a `data:` URI or base64 of an audio file."""
    from omniflow.media import MediaError, decode_audio

    if isinstance(value, torch.Tensor):
        audio = value.float().reshape(-1)
        if not len(audio):
            raise ARBackendError("ref_audio is empty")
        return audio
    text = value.strip()
    try:
        if os.path.isfile(text):
            with open(text, "rb") as f:
                data = f.read()
        else:
            payload = text.split(",", 1)[1] if text.startswith("data:") else text
            data = base64.b64decode(payload, validate=True)
        samples, rate = decode_audio(data)
    except (OSError, binascii.Error, ValueError, MediaError) as err:
        raise ARBackendError(
            f"ref_audio is neither a readable audio file nor base64 audio: {err}"
        ) from err
    if not len(samples):
        raise ARBackendError("ref_audio has no samples")
    return resample(samples.float(), rate, SAMPLE_RATE)

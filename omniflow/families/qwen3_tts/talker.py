"""The talker stage: Qwen3-TTS's talker and code predictor as a component of the
transformers `ar` backend (`omniflow.backends.transformers_ar`).

Each request's prefill is its task's prompt (`prompt.plan`, `prompt.embed`: those of requests
starting together built at once); each step samples codebook 0
from the talker's `codec_head`, then the code predictor fills codebooks 1..15 for every row
of the step at once (`frames`), and the frame goes out on `codes` as int64 `[1, 16]`; the
next step feeds the talker the sum of the frame's 16 codebook embeddings plus that step's
text-side row. End-of-speech (codec eos) ends the request (the backend's `Ending`,
"stop"; "length" at `max_tokens`) and emits no frame. A voice clone with reference codes
(ICL) first sends the reference's frames, every code offset by the codebook size (2048)
and the last frame's by twice that, as it starts (`ahead_codes`: at once, outside the
edge's chunk schedule, so that they do not hold the first frame back in a later, longer
chunk). code2wav decodes them as context only, while this stage prefills
(`code2wav.Code2Wav.context_frames`), as the reference decodes reference and new codes
together and cuts the reference's audio.

Sampling is `Qwen3TTSForConditionalGeneration.generate`'s: the checkpoint's
generation_config.json (temperature 0.9, top-k 50, top-p 1, repetition penalty 1.05 over
the codebook-0 ids generated so far), every special id but end-of-speech suppressed
(the top 1024 of the 3072), end-of-speech masked for the first two steps
(`min_new_tokens=2`, the component's `min_tokens`). The code predictor samples with the
sub-talker's settings (`subtalker_*`; `transformers_ar.sample_sub_step`): on CPU from the
request's own generator, right after the talker's draw, as `generate` does; on CUDA with
the fused sampler, keyed by the request's seed. A greedy request (temperature 0) is greedy
in both.

Decode paths: eager (the batched DynamicCache; the backend's `frames` runs the code
predictor for the batch from `frame_spec`, `transformers_ar.complete_frames`, and its
`step_embeds` feeds the frame back), or static (the default on CUDA, graph-captured: the
same `frame_spec` (the code predictor, its codebook tables and heads) has the step complete
each frame on the device, the first one after the prefill included,
`omniflow.backends.static_decode`); `step_extra` is the text-side
row both paths add; on both, an ICL clone's context goes ahead of its first frame.
The same checks of a request against the checkpoint run at admission
(`voices.admission`) and here (`config.check_task_inputs`).

Request inputs (ports) and parameters:

- `prompt` (text): what to say.
- `voice` (text): a CustomVoice speaker (case-insensitive; the stage's `speaker` parameter
  where no voice input is connected; empty: none, the reference's instruction-made
  speaker); given audio, it is the reference audio of a voice clone.
- `instructions` (text): CustomVoice's style instruction (1.7B only) or VoiceDesign's voice
  description; empty: none.
- `ref_audio` (text: the voice prompt the `voice_encoder` stage, `voices.VoiceEncoder`,
  made of the reference: its x-vector and codes) and `ref_text` (text): a Base
  checkpoint's voice clone. This stage loads no encoder.
- parameters `language` (Auto, Chinese, English, ... as the config lists them),
  `task_type` (CustomVoice, VoiceDesign or Base: must be the checkpoint's own; empty: it),
  `x_vector_only_mode` (clone from the speaker embedding alone; else ICL, which needs
  `ref_text`), `non_streaming_mode` (where the text goes: unset, the reference's default,
  true for CustomVoice and VoiceDesign, false for voice clones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniflow.backends.checkpoint_files import read_json
from omniflow.backends.static_decode import FrameSpec
from omniflow.backends.transformers_ar import (
    ARBackendError,
    Component,
    Prompt,
    Sequence,
    sub_sampling,
)
from omniflow.errors import OmniflowError
from omniflow.families.qwen3_tts import prompt as prompts
from omniflow.families.qwen3_tts import voices
from omniflow.families.qwen3_tts.config import (
    CONFIG,
    GENERATION_CONFIG,
    SAMPLING_DEFAULTS,
    Qwen3TTSError,
    TTSConfig,
    check_task_inputs,
)
from omniflow.families.qwen3_tts.modeling import Talker, load_talker
from omniflow.runtime.readback import upload
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
    except Qwen3TTSError as err:
        raise ARBackendError(str(err)) from err
    tokenizer = AutoTokenizer.from_pretrained(path)
    generation = {**SAMPLING_DEFAULTS, **(read_json(path, GENERATION_CONFIG) or {})}
    return QwenTTSTalker(talker, tokenizer, config, generation)


def _ok(ids) -> bool:
    """Whether a request's prompt ids were planned (not the error it fails with)."""
    return not isinstance(ids, OmniflowError)


@dataclass
class _Request:
    """A running request's text side and the input of its next step."""

    trailing: torch.Tensor  # [T, D]
    pad: torch.Tensor  # [D]
    context: torch.Tensor | None = None  # an ICL clone's reference frames, marked

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
    min_tokens = MIN_NEW_TOKENS

    def __init__(self, talker: Talker, tokenizer, config: TTSConfig, generation: dict):
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
        predictor = talker.code_predictor
        self.codebook_size = predictor.lm_head[0].out_features
        self.frame_spec = FrameSpec(
            predictor=predictor.model,
            project=predictor.small_to_mtp_projection,
            tables=predictor.model.codec_embedding,
            heads=predictor.lm_head,
            sampling=self.sub_sampling,
        )

    # --- prompts ----------------------------------------------------------------------------
    def can_start(self, call: Call) -> bool:
        return all(stream.ended for stream in call.inputs.values())

    def _text(self, call: Call, port: str) -> str:
        stream = call.inputs.get(port)
        value = stream.take() if stream is not None else None
        return value if isinstance(value, str) else ""

    def request(self, call: Call) -> prompts.TTSRequest:
        """The request's task inputs, checked against this checkpoint (the rules admission
        checks too: `config.check_task_inputs`)."""
        params = call.params or {}
        text = self._text(call, "prompt")
        if not text:
            raise ARBackendError("the text to speak is empty")
        voice = call.inputs["voice"].take() if "voice" in call.inputs else params.get("speaker")
        ref_audio = call.inputs["ref_audio"].take() if "ref_audio" in call.inputs else None
        if isinstance(voice, torch.Tensor):
            voice, ref_audio = None, voice if ref_audio is None or ref_audio == "" else ref_audio
        has_audio = isinstance(ref_audio, torch.Tensor) or bool(ref_audio)
        x_vector_only = bool(params.get("x_vector_only_mode"))
        ref_text = self._text(call, "ref_text")
        instructions = self._text(call, "instructions")
        clone = None
        if has_audio and self.config.task == "Base":  # its reference, read first
            clone = self._clone(ref_audio, x_vector_only or not ref_text)
        task = check_task_inputs(
            self.config,
            task_type=params.get("task_type") or None,
            language=params.get("language") or None,
            voice=voice or None,
            instructions=instructions,
            ref_audio=has_audio,
            ref_text=ref_text,
            x_vector_only=x_vector_only,
        )
        request = prompts.TTSRequest(
            text,
            task,
            language=params.get("language") or "auto",
            speaker=(voice or None) if task == "CustomVoice" else None,
            instructions=instructions,
            ref_text=ref_text,
            non_streaming=params.get("non_streaming_mode"),
        )
        if clone is not None:
            request.x_vector, codes = clone
            request.ref_codes = None if x_vector_only else codes
        prompts.language_id(self.layout, request.language, request.speaker)  # checked early
        return request

    def _clone(self, ref_audio, x_vector_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A clone's x-vector and reference codes, from the voice prompt the voice encoder
        stage made of its reference (`voices.VoiceEncoder`): this stage encodes nothing."""
        if not voices.is_prompt(ref_audio):
            raise Qwen3TTSError(
                "ref_audio reached the talker unencoded: a voice clone's reference goes "
                "through the voice_encoder stage (graphs/qwen3_tts.omni), which makes its "
                "voice prompt"
            )
        x_vector, codes = voices.decode_prompt(ref_audio)
        width = self.model.config.hidden_size
        if x_vector.shape[0] != width:
            raise Qwen3TTSError(
                f"ref_audio is a voice prompt of another model (an x-vector of "
                f"{x_vector.shape[0]}; this model's are {width} wide)"
            )
        if codes is not None and codes.shape[1] != self.model.groups:
            raise Qwen3TTSError(
                f"ref_audio is a voice prompt of another model ({codes.shape[1]} codebooks)"
            )
        weight = self.head.weight
        return upload(x_vector, weight.device, weight.dtype), codes

    def prompt(self, call: Call) -> Prompt:
        (built,) = self.prompts([call])
        if isinstance(built, OmniflowError):
            raise built
        return built

    def prompts(self, calls: list[Call]) -> list[Prompt | OmniflowError]:
        """The prompts of requests starting together, built together (`prompt.embed`: one
        upload, one text projection and one codec lookup for all of them), each or the
        error its request fails with."""
        plans: list[prompts.PromptIds | OmniflowError] = []
        for call in calls:
            try:
                plans.append(prompts.plan(self.tokenizer, self.layout, self.request(call)))
            except Qwen3TTSError as err:
                plans.append(ARBackendError(str(err)))
            except OmniflowError as err:
                plans.append(err)
        with torch.inference_mode():
            built = iter(prompts.embed(self.model, self.layout, [p for p in plans if _ok(p)]))
        out: list[Prompt | OmniflowError] = []
        for call, ids in zip(calls, plans, strict=True):
            if not _ok(ids):
                out.append(ids)
                continue
            prompt, codes = next(built), ids.request.ref_codes
            context = None
            if codes is not None:  # sent ahead of the first frame, marked (on the host)
                context = codes + self.codebook_size
                context[-1] += self.codebook_size  # the last: code2wav then has them all
            call.state[_STATE] = _Request(prompt.trailing, prompt.pad, context=context)
            out.append(Prompt(prompt.embeds, []))
        return out

    # --- steps ---------------------------------------------------------------------------
    def ahead_codes(self, seq: Sequence) -> torch.Tensor | None:
        """An ICL clone's reference frames, sent as it starts (its vocoder's context, which
        the vocoder decodes while this stage prefills): off the edge's schedule, so that the
        first frame is its first chunk."""
        return seq.call.state[_STATE].context

    def step_extra(self, seqs: list[Sequence]) -> torch.Tensor:
        """Each row's text side of its next step: after n frames, row n - 1 of the trailing
        text (the prefill fed the rows before them), then the pad."""
        return torch.stack([s.call.state[_STATE].text_side(s.next_step - 1) for s in seqs])

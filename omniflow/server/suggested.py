"""The requests a starting server suggests trying: a `curl` line per served pipeline, for
its first endpoint, printed under `omniflow: serving ...`.

Each is sized to answer in seconds on a CPU with `--tiny`: a pipeline's defaults are its
real model's (graphs/text_to_video.omni: 832x480, 81 frames, 40 steps, minutes on a CPU
even with tiny weights; a TTS talker on random weights speaks to its 2048-token limit), so
the request names small sizes, few frames and steps, and a token limit, each only where
the pipeline takes that field. A pipeline that clones voices (it has no named speakers)
gets the upload of a clip and a request naming it.
"""

from __future__ import annotations

import json
import shlex

from omniflow.server.params import Params
from omniflow.server.served import ENDPOINTS

# Per endpoint: the request's body, and the fields that keep it small, where the pipeline
# takes them (`size` where it has a width and a height).
BODIES = {
    "chat": {"messages": [{"role": "user", "content": "Hello!"}]},
    "speech": {"input": "Hello!"},
    "images": {"prompt": "a red boat"},
    "videos": {"prompt": "a cat walks"},
}
SMALL = {
    "chat": {"max_tokens": 16, "max_audio_tokens": 240},
    "speech": {"max_new_tokens": 100},
    "images": {"size": "256x256", "num_inference_steps": 4},
    "videos": {"size": "256x256", "num_frames": 9, "num_inference_steps": 4},
}
# Inputs a request must bring as files: a pipeline that needs one gets no suggestion.
MEDIA = ("image", "audio", "video")
VOICE_NAME = "myvoice"
CLIP = "reference.wav"  # the clip the upload suggestion names: the user's own


def suggested_requests(served, base: str, api_key: bool) -> list[str]:
    """`curl` lines to paste for `served` (a `Served`) at `base`, its first endpoint's; []
    where it has none, or every request needs a media file (an image to understand or to
    animate)."""
    auth = ' -H "Authorization: Bearer $OMNIFLOW_API_KEY"' if api_key else ""
    endpoint = next((c for c in served.capabilities if c in BODIES), None)
    media = [p for p in served.inputs_of(*MEDIA) if p.default is None and not p.optional]
    if endpoint is None or media:  # a request needs the user's own file: none suggested
        return []
    params = Params(served)
    body = {"model": served.name, **BODIES[endpoint]}
    for field, value in SMALL[endpoint].items():
        takes = ("width", "height") if field == "size" else (field,)
        if all(params.target(name) is not None for name in takes):
            body[field] = value
    lines = []
    if endpoint == "speech" and clones(served):
        lines.append(
            f"curl {base}/v1/audio/voices{auth} -F name={VOICE_NAME} -F audio=@{CLIP} "
            "-F ref_text='What the clip says.'"
        )
        body["voice"] = VOICE_NAME
    lines.append(
        f"curl {base}{ENDPOINTS[endpoint]}{auth} -H 'Content-Type: application/json' "
        f"-d {shlex.quote(json.dumps(body))}"
    )
    return lines


def clones(served) -> bool:
    """Whether `served` is a speech pipeline that clones voices and has no named ones."""
    entry = served.voice_entry
    return entry is not None and not served.speakers and entry.clones_voices()

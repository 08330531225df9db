"""Omni chat end to end — thinker, talker and token2wav as three stages in two executor
processes, streaming — gives the audio of the unsplit model's own `generate` (greedy, same
speaker and seed) on tiny:qwen2.5-omni."""

import pytest
import torch

from omniflow.checkpoints.tiny import build_tiny
from omniflow.compiler import compile_source
from omniflow.families.qwen2_5_omni.checkpoints import reference_omni_generate
from omniflow.runtime.engine import Engine

torch.set_num_threads(1)

SOURCE = """
pipeline omni_audio {
  model "tiny:qwen2.5-omni"
  param max_tokens = 24
  stage thinker  = ar(component="thinker", max_batch=2, max_tokens=$max_tokens, temperature=0.0)
  stage talker   = ar(component="talker", max_batch=2, max_tokens=48, temperature=0.0, speaker="Chelsie")
  stage code2wav = vocoder(component="token2wav", max_batch=2, speaker="Chelsie", seed=0)
  input prompt: chat -> thinker
  thinker.hidden -> talker   [stream, chunk=1, adapter=qwen_omni.thinker_to_talker]
  talker.codes   -> code2wav [stream, chunk=auto, context=25, adapter=qwen_omni.talker_to_code2wav]
  code2wav.audio -> output audio [stream, rate=24000]
  thinker.text   -> output text [stream]
}
"""


@pytest.mark.slow
def test_streamed_three_stage_audio_equals_the_monolithic_generate():
    # A short reply the talker speaks past (to its 48 codes): long enough to stream in chunks.
    prompt = "Tell me a short story."
    reference = reference_omni_generate(
        build_tiny("qwen2.5-omni"), prompt, max_new_tokens=6, talker_max_new_tokens=48
    )
    plan = compile_source(SOURCE, "omni_audio.omni", devices="cpu")
    assert [x.stage_names for x in plan.executors] == [["thinker", "talker"], ["code2wav"]]
    with Engine(plan, "process") as engine:
        chunks = list(engine.stream_sync({"prompt": prompt}, {"max_tokens": 6}))
    text = "".join(c.value for c in chunks if c.output == "text" and c.value)
    audio = torch.cat(
        [c.value for c in chunks if c.output == "audio" and c.value is not None]
    ).reshape(-1)
    assert text == reference.text
    assert sum(c.output == "audio" and c.value is not None for c in chunks) > 1  # it streamed
    want = reference.waveform.reshape(-1).float()
    assert audio.shape == want.shape
    # token2wav decodes in windows with two DiT blocks of context and lookahead, which
    # truncates its non-local DiT: measured 4.9e-5 of the waveform's peak.
    assert float((audio - want).abs().max()) < 1e-4 * float(want.abs().max())

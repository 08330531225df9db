"""Run Qwen's own `qwen_tts` package (the reference implementation) on tiny Qwen3-TTS
checkpoints, and save what it generates: the oracle of tests/families/test_qwen3_tts.py.

It needs a Python where `qwen-tts` imports and runs: the official package pins
transformers==4.57.3, so it lives outside omniflow's environment, e.g.

    python3 -m venv /tmp/qwen-tts && /tmp/qwen-tts/bin/pip install torch==2.13.0 \\
        transformers==4.57.3 accelerate==1.12.0 librosa einops soundfile
    /tmp/qwen-tts/bin/pip install --no-deps qwen-tts==0.1.1

and it imports nothing of omniflow. Usage: `python qwen_tts_reference.py CASES.json OUT.safetensors`,
with CASES a list of {"name", "model_dir", "task", "text", "language", "speaker",
"instructions", "ref_audio", "ref_text", "x_vector_only_mode", "non_streaming_mode",
"max_new_tokens"}. For each case it saves `NAME.codes` (the greedy talker codes that
`generate` returns, [frames, 16]) and `NAME.audio` (the speech tokenizer's decode of them);
for a voice clone also `NAME.ref_code` and `NAME.x_vector` (what `create_voice_clone_prompt`
makes of the reference audio); and `NAME.missing` / `NAME.unexpected`, the numbers of
weights `from_pretrained` did not find in, or did not use from, the checkpoint.

The 25 Hz tokenizer module of the package imports torchaudio (and sox, onnxruntime); only
the 12 Hz one runs here, so where those do not import the package's top-level modules are
set up without it (the 12 Hz modules are the package's own files, unchanged).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch


def import_qwen_tts():
    try:
        import qwen_tts  # noqa: F401
        from qwen_tts import Qwen3TTSModel  # noqa: F401
    except Exception:  # the 25 Hz tokenizer's dependencies: load the 12 Hz path alone
        for name in [m for m in sys.modules if m == "qwen_tts" or m.startswith("qwen_tts.")]:
            del sys.modules[name]
        root = Path(importlib.util.find_spec("qwen_tts").origin).parent
        for name, path in (("qwen_tts", root), ("qwen_tts.core", root / "core")):
            module = types.ModuleType(name)
            module.__path__ = [str(path)]
            sys.modules[name] = module
        if (root / "_transformers_compat.py").exists():
            importlib.import_module(
                "qwen_tts._transformers_compat"
            ).patch_transformers_rope_registry()
        core = sys.modules["qwen_tts.core"]
        v2 = "qwen_tts.core.tokenizer_12hz."
        core.Qwen3TTSTokenizerV2Config = importlib.import_module(
            v2 + "configuration_qwen3_tts_tokenizer_v2"
        ).Qwen3TTSTokenizerV2Config
        core.Qwen3TTSTokenizerV2Model = importlib.import_module(
            v2 + "modeling_qwen3_tts_tokenizer_v2"
        ).Qwen3TTSTokenizerV2Model
        # The 25 Hz tokenizer, never run here, registered under its name as a class that
        # cannot load, so that the 12 Hz registration beside it goes through.
        from transformers import PretrainedConfig, PreTrainedModel

        class Unavailable25HzConfig(PretrainedConfig):
            model_type = "qwen3_tts_tokenizer_25hz"

        class Unavailable25HzModel(PreTrainedModel):
            config_class = Unavailable25HzConfig

        core.Qwen3TTSTokenizerV1Config = Unavailable25HzConfig
        core.Qwen3TTSTokenizerV1Model = Unavailable25HzModel
    return importlib.import_module("qwen_tts.inference.qwen3_tts_model")


def load_model(inference, model_dir: str):
    """`Qwen3TTSModel.from_pretrained`, but for the text tokenizer: a tiny checkpoint's is
    saved by transformers 5 (tokenizer.json and a v5 tokenizer_config.json), which
    transformers 4.57 reads only as the fast tokenizer of that tokenizer.json."""
    from transformers import AutoConfig, AutoModel, Qwen2TokenizerFast

    core = sys.modules["qwen_tts.core.models"]
    AutoConfig.register("qwen3_tts", core.Qwen3TTSConfig)
    AutoModel.register(core.Qwen3TTSConfig, core.Qwen3TTSForConditionalGeneration)
    model = AutoModel.from_pretrained(model_dir)
    tokenizer = Qwen2TokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
    processor = core.Qwen3TTSProcessor(tokenizer=tokenizer)
    return inference.Qwen3TTSModel(model, processor, generate_defaults=model.generate_config)


def run_case(inference, case: dict, out: dict) -> None:
    import soundfile as sf

    name = case["name"]
    model = load_model(inference, case["model_dir"])
    _count_loading(model.model, Path(case["model_dir"]), name, out)
    kwargs = dict(
        do_sample=False,
        subtalker_dosample=False,
        max_new_tokens=case["max_new_tokens"],
        non_streaming_mode=case["non_streaming_mode"],
    )
    if case["task"] == "CustomVoice":
        wavs, _ = model.generate_custom_voice(
            case["text"],
            case["speaker"],
            case["language"],
            case.get("instructions") or None,
            **kwargs,
        )
        codes = _codes(model)
    elif case["task"] == "VoiceDesign":
        wavs, _ = model.generate_voice_design(
            case["text"], case["instructions"], case["language"], **kwargs
        )
        codes = _codes(model)
    else:
        audio, rate = sf.read(case["ref_audio"], dtype="float32")
        items = model.create_voice_clone_prompt(
            (audio, rate), case.get("ref_text") or None, case["x_vector_only_mode"]
        )
        wavs, _ = model.generate_voice_clone(
            case["text"], case["language"], voice_clone_prompt=items, **kwargs
        )
        codes = _codes(model)
        out[f"{name}.x_vector"] = items[0].ref_spk_embedding.float().cpu().contiguous()
        if items[0].ref_code is not None:
            out[f"{name}.ref_code"] = items[0].ref_code.cpu().contiguous()
    out[f"{name}.codes"] = codes.cpu().contiguous()
    decoded = model.model.speech_tokenizer.decode([{"audio_codes": codes}])[0][0]
    out[f"{name}.audio"] = torch.as_tensor(decoded).float().contiguous()
    # What the API returns: for an ICL clone, reference and new codes decoded together and
    # the reference's share cut off.
    out[f"{name}.wav"] = torch.as_tensor(wavs[0]).float().contiguous()


def _codes(model) -> torch.Tensor:
    return model.model._omniflow_last_codes


def main(argv: list[str]) -> None:
    from safetensors.torch import save_file

    cases = json.loads(Path(argv[0]).read_text())
    inference = import_qwen_tts()
    # generate() returns codes and hidden states; the wrappers keep only the waveform, so
    # record the codes the talker returned on the instance (nothing else changes).
    cls = inference.Qwen3TTSForConditionalGeneration
    original = cls.generate

    def recording(self, *args, **kwargs):
        codes, hidden = original(self, *args, **kwargs)
        self._omniflow_last_codes = codes[0]
        return codes, hidden

    cls.generate = recording
    out: dict[str, torch.Tensor] = {}
    for case in cases:
        run_case(inference, case, out)
    save_file(out, argv[1])


def _count_loading(model, root: Path, name: str, out: dict) -> None:
    """How many of the model's weights the checkpoint lacks, and how many of its tensors
    the model has no place for."""
    from safetensors import safe_open

    with safe_open(str(root / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    own = set(model.state_dict())
    out[f"{name}.missing"] = torch.tensor(len(own - stored))
    out[f"{name}.unexpected"] = torch.tensor(len(stored - own))


if __name__ == "__main__":
    main(sys.argv[1:])

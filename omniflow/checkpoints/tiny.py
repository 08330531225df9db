"""Tiny offline checkpoints of real architectures, and the monolithic references they run.

Nothing can be downloaded where omniflow's tests run, so tests use tiny random-weight
models of the real architectures, built here from configs (see `tiny_recipes`) and loaded
through the same `from_pretrained(local_dir)` path as a real checkpoint.

- `build_tiny(name)` builds a checkpoint directory, or reuses a complete one, under
  `$OMNIFLOW_CACHE/tiny/<name>` (OMNIFLOW_CACHE defaults to ~/.cache/omniflow). A build
  writes into a temporary sibling directory and renames it into place, and a directory
  counts as complete only with its manifest (written last), so an interrupted build is
  never mistaken for a complete one.
- `TINY_MODELS`, `list_tiny()` name what can be built.
- `reference_omni_generate`, `reference_vl_generate` and `reference_tts` run each model
  unsplit, the way its own code does, as the oracle that omniflow's staged pipelines are
  compared against.
  For `text-to-image` and `image-edit` the reference is the diffusers pipeline's own
  `__call__` (the edit pipeline given the processor that
  `omniflow.backends.diffusion.load_processor` builds: diffusers' loading of it needs
  torchvision).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from omniflow.checkpoints.tiny_recipes import (
    RECIPE_VERSION,
    RECIPES,
    TTS_INDEX,
    Recipe,
)
from omniflow.hf_logging import quiet
from omniflow.hints import did_you_mean

TINY_MODELS: dict[str, str] = {name: recipe.description for name, recipe in RECIPES.items()}
# Written last into a finished checkpoint: what built it and every file's size and hash.
MANIFEST = "omniflow_tiny.json"
_TEMP_MARK = ".tmp-"


def list_tiny() -> list[str]:
    """Names `build_tiny` accepts, sorted."""
    return sorted(TINY_MODELS)


def tiny_cache_dir() -> Path:
    """Where `build_tiny` puts checkpoints by default: `$OMNIFLOW_CACHE/tiny`."""
    root = os.environ.get("OMNIFLOW_CACHE") or Path.home() / ".cache" / "omniflow"
    return Path(root).expanduser() / "tiny"


def build_tiny(name: str, out_dir: str | Path | None = None, progress: bool = False) -> Path:
    """Build the tiny checkpoint `name` (or reuse a complete one) and return its directory.

    `out_dir` defaults to `tiny_cache_dir() / name`. A directory is reused when its
    manifest names the same recipe version and library versions and every file it lists is
    there with its size; otherwise it is rebuilt and replaced. `progress` shows a bar over
    the parts being built.
    """
    recipe = _recipe(name)
    final = Path(out_dir).expanduser() if out_dir is not None else tiny_cache_dir() / name
    if is_complete(final, name):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(final)
    temp = final.with_name(f".{final.name}{_TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    temp.mkdir()
    try:
        with quiet(), _progress_bar(recipe, progress) as start_part:
            for part in recipe.build(temp):
                start_part(part)
        _write_manifest(temp, name)
        _publish(temp, final, name)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return final


def is_complete(directory: str | Path, name: str) -> bool:
    """Whether `directory` holds a finished build of `name` by this recipe and libraries."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if manifest.get("name") != name or manifest.get("built_with") != _built_with():
        return False
    return all(
        (directory / rel).is_file() and (directory / rel).stat().st_size == entry["bytes"]
        for rel, entry in manifest.get("files", {}).items()
    )


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        hint = did_you_mean(name, RECIPES)
        raise KeyError(
            f"unknown tiny model '{name}' (known: {', '.join(list_tiny())})"
            + (f"; {hint}" if hint else "")
        )
    return RECIPES[name]


def _built_with() -> dict[str, str | int | None]:
    """What a checkpoint's bytes depend on besides its recipe name (None: not installed)."""
    versions: dict[str, str | int | None] = {"recipe_version": RECIPE_VERSION}
    for package in ("torch", "transformers", "diffusers", "tokenizers", "safetensors", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _write_manifest(directory: Path, name: str) -> None:
    files = {
        path.relative_to(directory).as_posix(): {
            "bytes": path.stat().st_size,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    manifest = {"name": name, "built_with": _built_with(), "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def _publish(temp: Path, final: Path, name: str) -> None:
    """Move a finished build into place, replacing a stale or incomplete directory.

    If another process published a complete build first, keep theirs.
    """
    if final.exists():
        if is_complete(final, name):
            return
        stale = final.with_name(f".{final.name}{_TEMP_MARK}stale-{uuid.uuid4().hex[:8]}")
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        temp.rename(final)
    except OSError:
        if not is_complete(final, name):
            raise


def _remove_abandoned_builds(final: Path) -> None:
    """Delete temporary build directories of `final` whose building process is gone."""
    for temp in final.parent.glob(f".{final.name}{_TEMP_MARK}*"):
        owner = temp.name.removeprefix(f".{final.name}{_TEMP_MARK}").split("-")[0]
        if not (owner.isdigit() and _process_alive(int(owner))):
            shutil.rmtree(temp, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _progress_bar(recipe: Recipe, enabled: bool) -> Iterator[Callable[[str], None]]:
    """Yield `start_part(label)`, which a build calls before each part of the recipe."""
    if not enabled:
        yield lambda label: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    # On stderr: stdout may be a plan's JSON or a checkpoint's path that a script reads.
    with Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(f"tiny {recipe.name}", total=len(recipe.parts))
        started = 0

        def start_part(label: str) -> None:
            nonlocal started
            bar.update(task, completed=started, description=f"tiny {recipe.name}: {label}")
            started += 1

        yield start_part
        bar.update(task, completed=len(recipe.parts), description=f"tiny {recipe.name}")


# --- monolithic references -------------------------------------------------------------------


class OmniReference(NamedTuple):
    """What `reference_omni_generate` returns.

    text_ids: the generated text tokens (prompt excluded), shape (n,), int64.
    text: text_ids decoded, special tokens skipped.
    codec_ids: the talker's codes that token2wav decoded (ends-of-speech excluded), (m,).
    waveform: token2wav's 24 kHz audio, shape (samples,), float32.
    """

    text_ids: torch.Tensor
    text: str
    codec_ids: torch.Tensor
    waveform: torch.Tensor


class TTSReference(NamedTuple):
    """What `reference_tts` returns.

    codes: the codec frames (one codebook), ids in the codec's own 0..codebook_size-1
    range, shape (frames,), int64. waveform: the decoded 24 kHz audio, (samples,), float32.
    """

    codes: torch.Tensor
    waveform: torch.Tensor


def omni_prompt_ids(tokenizer, prompt_text: str) -> torch.Tensor:
    """The (1, n) input ids of a one-turn chat with the omni model's default system prompt."""
    messages = [{"role": "user", "content": prompt_text}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def reference_omni_generate(
    model_dir: str | Path,
    prompt_text: str,
    max_new_tokens: int = 16,
    *,
    speaker: str = "Chelsie",
    talker_max_new_tokens: int = 64,
    seed: int = 0,
    **generate_kwargs,
) -> OmniReference:
    """Qwen2.5-Omni's own `generate`: thinker text, then talker codes, then token2wav audio.

    Runs `Qwen2_5OmniForConditionalGeneration.generate` with greedy thinker and talker
    decoding and otherwise the model's own defaults (the talker's repetition penalty of
    1.05 included); extra keyword arguments pass through (`talker_repetition_penalty=1.0`,
    `token2wav_num_steps=...`). Two settings are not the class's literal defaults: the
    talker's end-of-speech ids come from this checkpoint's config (the class hard-codes
    the real model's 8292/8294), and the global torch RNG is seeded with `seed` just
    before `generate` — greedy decoding draws nothing, so token2wav's initial noise is the
    first `torch.randn` after `torch.manual_seed(seed)`.
    """
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir).eval()
    talker_config = model.config.talker_config
    end_of_speech = [talker_config.tts_codec_pad_token_id, talker_config.tts_codec_end_token_id]
    input_ids = omni_prompt_ids(tokenizer, prompt_text)

    # generate() returns only text and audio; the codes it decodes are the talker's
    # output, so watch the talker's generate on this instance to keep them.
    talker_outputs = []
    talker_generate = model.talker.generate

    def recording_generate(*args, **kwargs):
        sequences = talker_generate(*args, **kwargs)
        talker_outputs.append(sequences[:, kwargs["input_ids"].shape[1] :])
        return sequences

    model.talker.generate = recording_generate
    torch.manual_seed(seed)
    with quiet():
        sequences, waveform = model.generate(
            input_ids,
            speaker=speaker,
            thinker_max_new_tokens=max_new_tokens,
            thinker_do_sample=False,
            talker_max_new_tokens=talker_max_new_tokens,
            talker_do_sample=False,
            talker_eos_token_id=end_of_speech,
            **generate_kwargs,
        )
    text_ids = sequences[0, input_ids.shape[1] :]
    codes = talker_outputs[0][0]
    # The model decodes the codes before the first end-of-speech id, as here.
    ends = torch.isin(codes, torch.tensor(end_of_speech)).nonzero()
    codec_ids = codes[: int(ends[0]) if len(ends) else len(codes)]
    text = tokenizer.decode(text_ids, skip_special_tokens=True)
    return OmniReference(text_ids, text, codec_ids, waveform)


class VLReference(NamedTuple):
    """What `reference_vl_generate` returns: the generated ids (prompt excluded), (n,)
    int64, the image's patch grid `image_grid_thw` (1, 3), and the ids decoded."""

    text_ids: torch.Tensor
    image_grid_thw: torch.Tensor
    text: str


@torch.no_grad()
def reference_vl_generate(
    model_dir: str | Path, prompt_text: str, image, max_new_tokens: int = 16
) -> VLReference:
    """Qwen2.5-VL's own `generate` on one image and one user turn, greedy.

    `image` is what the image processor takes (a PIL image, a uint8 [H, W, 3] array or
    tensor) or a path, opened with PIL as RGB. The inputs are what `Qwen2_5_VLProcessor`
    makes, which cannot be constructed without torchvision: the image processor's pixel
    patches and grid; the chat template on `[image, text]`, its `<|image_pad|>` repeated
    once per merged patch; `mm_token_type_ids` 1 on those tokens, 0 elsewhere.
    """
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    with quiet():
        processor = AutoImageProcessor.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    if isinstance(image, (str, Path)):
        with Image.open(image) as opened:
            image = opened.convert("RGB")
    elif isinstance(image, torch.Tensor):
        image = image.numpy()
    pixels = processor(images=[image], return_tensors="pt")
    grid = pixels["image_grid_thw"]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt_text}]}
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    placeholder = tokenizer.convert_ids_to_tokens(model.config.image_token_id)
    tokens = int(grid.prod()) // processor.merge_size**2
    inputs = tokenizer(text.replace(placeholder, placeholder * tokens), return_tensors="pt")
    with quiet():
        sequences = model.generate(
            **inputs,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=grid,
            mm_token_type_ids=(inputs.input_ids == model.config.image_token_id).int(),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    text_ids = sequences[0, inputs.input_ids.shape[1] :]
    return VLReference(text_ids, grid, tokenizer.decode(text_ids, skip_special_tokens=True))


def read_tts_index(model_dir: str | Path) -> dict:
    """The tts checkpoint's index: its parts and its codec-token layout."""
    return json.loads((Path(model_dir) / TTS_INDEX).read_text(encoding="utf-8"))


def tts_prompt_ids(model_dir: str | Path, tokenizer, text: str, voice: str) -> torch.Tensor:
    """The (1, n) talker input ids for `text` in `voice`: text, speaker token, codec bos."""
    index = read_tts_index(model_dir)
    if voice not in index["speakers"]:
        raise KeyError(f"unknown voice '{voice}' (known: {', '.join(index['speakers'])})")
    text_ids = tokenizer(index["text_template"].format(text=text)).input_ids
    ids = [*text_ids, index["speakers"][voice], index["codec_bos_token_id"]]
    return torch.tensor([ids])


@torch.no_grad()
def reference_tts(
    model_dir: str | Path, text: str, voice: str = "Vivian", max_new_tokens: int = 32
) -> TTSReference:
    """The unsplit tts pipeline: the talker generates codes greedily, code2wav decodes all.

    The talker's generation config suppresses every id but codec tokens and the codec
    end-of-speech id, so `generate` emits only codes until it stops.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    index = read_tts_index(model_dir)
    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(model_dir / index["tokenizer_subfolder"])
        talker = AutoModelForCausalLM.from_pretrained(model_dir / "talker").eval()
        code2wav = AutoModel.from_pretrained(model_dir / "code2wav").eval()
    input_ids = tts_prompt_ids(model_dir, tokenizer, text, voice)
    generated = talker.generate(input_ids, max_new_tokens=max_new_tokens)[0, input_ids.shape[1] :]
    codes = generated[generated != index["codec_eos_token_id"]] - index["codec_token_offset"]
    waveform = code2wav.decode(audio_codes=codes.view(1, 1, -1)).audio_values
    return TTSReference(codes, waveform.reshape(-1))

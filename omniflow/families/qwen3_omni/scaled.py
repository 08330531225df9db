"""A real-size random-weight Qwen3-Omni, for measuring on a GPU without the weights.

`scaled_config(depth)` is the published Qwen3-Omni-30B-A3B-Instruct configuration (every
width, head and expert count and vocabulary of the builtin catalog's copy; the published
codec, speaker and RoPE layout) on the tiny checkpoint's tokenizer and its special ids,
with each stack's layer count multiplied by `depth` (1 = the real model: 35.3 B
parameters, 66 GiB in bf16).

`build_scaled(out, depth, device)` makes it in bf16 on `device` as transformers makes an
untrained model (plus the talker's experts and router, which transformers 5.24 leaves
uninitialised), and writes it as `save_pretrained` would (the same tensor names,
per-expert MoE weights included, the same index), but shard by shard: each shard is copied
to the host and written, then freed, so the host holds one shard (`shard_bytes`, 4 GiB)
besides the model on the device. That is what the real size needs on an H200 host with
64 GiB of disk and 128 GiB of memory: the model (66 GiB) fits the GPU, not the disk. A
shard goes into the first of `out` and the `spill` folders (e.g. `/dev/shm/...`, which is
memory; by default `/dev/shm/omniflow_scaled/<out's name>`, removed again if it took none)
with room for it, and a shard written elsewhere gets a symbolic link in `out`, so
`from_pretrained(out)` reads a checkpoint spread over disk and memory as one folder.
`MANIFEST`, written last, marks a finished build.

Random heads would end text and speech at random points, so the rows of the thinker's
end-of-turn ids (and of ids past its text tokens) and the talker's end of speech are
zeroed: every request runs to its token limits and every system measured on it does the
same work.

    omniflow models build-scaled Qwen/Qwen3-Omni-30B-A3B-Instruct --out /root/qwen3-omni
    python -m omniflow.families.qwen3_omni.scaled --out /root/qwen3-omni --spill /dev/shm/q3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from omniflow.checkpoints.scaled import MANIFEST, check_depth, initialising_bf16_on, scaled_layers
from omniflow.checkpoints.tiny_recipes import silence_rows, special_ids
from omniflow.families.qwen3_omni import (
    AUDIO_TOKENS,
    CODEBOOK_OFFSETS,
    REAL_MODEL,
    SPEAKERS,
)
from omniflow.hf_logging import quiet

SHARD_BYTES = 4 * 2**30
# Room a folder keeps free after a shard is written into it.
MARGIN_BYTES = 2**30
CODEBOOK = 2048  # the published codebook; the codec specials sit after it
# Multimodal RoPE of a 128-dim head, as published: 64 frequency pairs, interleaved.
_MROPE = {
    "rope_type": "default",
    "rope_theta": 1000000.0,
    "mrope_section": [24, 20, 20],
    "interleaved": True,
}
_STACKS = ("num_hidden_layers", "encoder_layers", "depth")


def scaled_config(depth: float = 1.0):
    """(Qwen3OmniMoeConfig, tokenizer) at the published widths and `depth` x its layers."""
    from transformers import Qwen3OmniMoeConfig

    from omniflow.catalog.components import builtin_files
    from omniflow.families.qwen3_omni.checkpoints import tiny_config, tiny_tokenizer

    check_depth(depth)
    tokenizer = tiny_tokenizer()
    with quiet():  # the tiny config's ids warn against its tiny vocabularies
        config = tiny_config(tokenizer).to_dict()
    real = builtin_files(REAL_MODEL)["config.json"]
    thinker, talker = config["thinker_config"], config["talker_config"]
    for target, source in (
        (thinker["text_config"], real["thinker_config"]["text_config"]),
        (thinker["audio_config"], real["thinker_config"]["audio_config"]),
        (thinker["vision_config"], real["thinker_config"]["vision_config"]),
        (talker["text_config"], real["talker_config"]["text_config"]),
        (talker["code_predictor_config"], real["talker_config"]["code_predictor_config"]),
        (config["code2wav_config"], real["code2wav_config"]),
    ):
        _published(target, source, depth)
    for text in (thinker["text_config"], talker["text_config"]):
        text["rope_parameters"] = dict(_MROPE)
    # The one size of the tiny recipe the catalog's copy does not state: the class default.
    talker["code_predictor_config"].pop("max_position_embeddings")
    talker["code_predictor_config"]["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1000000.0,
    }
    config["code2wav_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    vision = thinker["vision_config"]
    layers, published = vision["depth"], real["thinker_config"]["vision_config"]["depth"]
    vision["deepstack_visual_indexes"] = sorted(
        {min(layers - 1, round(i * layers / published)) for i in vision["deepstack_visual_indexes"]}
    )
    text_layers = thinker["text_config"]["num_hidden_layers"]
    for key in ("num_code_groups", "thinker_hidden_size", "spatial_merge_size"):
        talker[key] = real["talker_config"][key]
    # The talker reads the middle layer's hidden states (24 of 48), wherever that is.
    talker["accept_hidden_layer"] = max(
        1, min(text_layers - 1, round(real["talker_config"]["accept_hidden_layer"] * depth))
    )
    talker.update({name: CODEBOOK + offset for name, offset in CODEBOOK_OFFSETS.items()})
    talker["speaker_id"] = {name: CODEBOOK + offset for name, offset in SPEAKERS.items()}
    config.pop("transformers_version", None)
    return Qwen3OmniMoeConfig(**config), tokenizer


def _published(target: dict[str, Any], source: dict[str, Any], depth: float) -> None:
    """Give a tiny sub-config the published one's values, its stacks `depth` x as deep."""
    for key, value in source.items():
        if key in ("model_type", "rope_theta"):
            continue
        target[key] = copy.deepcopy(value)
        if key in _STACKS:
            target[key] = scaled_layers(value, depth)
    target.pop("layer_types", None)  # derived from the layer count again
    if "num_experts" in source:  # `to_dict` spells it by its attribute_map alias
        target.pop("num_local_experts", None)


def build_scaled(
    out: str | Path,
    depth: float = 1.0,
    device: str = "cuda",
    spill: list[str | Path] | tuple[str | Path, ...] | None = None,
    shard_bytes: int = SHARD_BYTES,
    config=None,
    tokenizer=None,
) -> Path:
    """Build and write a random-weight Qwen3-Omni (`scaled_config(depth)`, or `config` over
    `tokenizer`); returns the folder. See the module docstring for where shards go; `spill`
    None is `/dev/shm/omniflow_scaled/<out's name>` where there is a /dev/shm (used only
    once `out` is full; not `omniflow-*`, the names of the runtime's shared-memory
    segments), as `omniflow models build-scaled` builds it."""
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    from omniflow.families.qwen2_5_omni.checkpoints import save_processor_parts
    from omniflow.families.qwen3_omni.checkpoints import IMAGE_PROCESSOR
    from omniflow.families.qwen3_omni.towers import VIDEO_DEFAULTS

    if config is None:
        config, tokenizer = scaled_config(depth)
    out = Path(out)
    if spill is None:
        shm = Path("/dev/shm")
        spill = [shm / "omniflow_scaled" / out.name] if shm.is_dir() else []
    folders = [out, *(Path(s) for s in spill)]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    with quiet():
        tokenizer.save_pretrained(out)
    # The processor's parts, as the tiny checkpoint's (the towers' stages read them).
    save_processor_parts(out, IMAGE_PROCESSOR, VIDEO_DEFAULTS)
    with initialising_bf16_on(device):
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
        _initialise_the_talkers_experts(model)
    ids = special_ids(tokenizer)
    head = model.thinker.lm_head.weight
    silence_rows(head, ids[AUDIO_TOKENS[0]])
    with torch.no_grad():
        head[[ids["<|im_end|>"], ids["<|endoftext|>"]]] = 0
        model.talker.codec_head.weight[config.talker_config.codec_eos_token_id] = 0
    model.config.dtype = torch.bfloat16
    model.config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    ).save_pretrained(out)
    shards = write_shards(model, out, folders, shard_bytes)
    del model
    for folder in folders[1:]:  # a spill folder no shard needed goes again
        if not any(folder.iterdir()):
            folder.rmdir()
    manifest = {"model": REAL_MODEL, "depth": depth, "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def _initialise_the_talkers_experts(model) -> None:
    """transformers initialises the thinker's experts and router but not the talker's (their
    classes are not the thinker's): its experts stay `torch.empty` and its router zero.
    They get the same init as the thinker's: normal, std `initializer_range`."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeTalkerTextExperts,
        Qwen3OmniMoeTalkerTextTopKRouter,
    )

    std = model.config.talker_config.initializer_range
    with torch.no_grad():
        for module in model.talker.modules():
            if isinstance(module, Qwen3OmniMoeTalkerTextExperts):
                module.gate_up_proj.normal_(0.0, std)
                module.down_proj.normal_(0.0, std)
            elif isinstance(module, Qwen3OmniMoeTalkerTextTopKRouter):
                module.weight.normal_(0.0, std)


def write_shards(model, out: Path, folders: list[Path], shard_bytes: int) -> dict[str, str]:
    """Write `model`'s weights as `save_pretrained` names them (tied weights once, the
    weight conversions reverted: per-expert MoE tensors), in shards of about `shard_bytes`
    (whole layers: a layer's experts revert together), each reverted and copied to the host
    only while it is written (the per-expert gate and up projections are copies: reverting
    the whole model at once would take 40 GB more of the GPU), into the first of `folders`
    with room for it (linked from `out`), and the index. Returns shard -> its folder."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    units: dict[str, list[str]] = {}
    for name in state:
        units.setdefault(_unit(name), []).append(name)
    shards: list[list[list[str]]] = [[]]
    size = 0
    for names in units.values():
        nbytes = sum(state[n].numel() * state[n].element_size() for n in names)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(names)
        size += nbytes
    weight_map, placed, total = {}, {}, 0
    for i, shard_units in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        shard = {}
        for names in shard_units:
            reverted = revert_weight_conversion(model, {n: state.pop(n) for n in names})
            shard.update({n: t.detach().to("cpu").contiguous() for n, t in reverted.items()})
            del reverted
        nbytes = sum(t.numel() * t.element_size() for t in shard.values())
        folder = _room_for(folders, nbytes)
        save_file(shard, str(folder / filename), metadata={"format": "pt"})
        if folder != out:
            link = out / filename
            link.unlink(missing_ok=True)
            link.symlink_to((folder / filename).resolve())
            print(f"{filename}: {nbytes / 2**30:.1f} GiB in {folder} (no room in {out})")
        weight_map.update(dict.fromkeys(shard, filename))
        placed[filename] = str(folder)
        total += nbytes
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    (out / "model.safetensors.index.json").write_text(text)
    return placed


def _unit(name: str) -> str:
    """The layer a weight belongs to (`... .layers.N.` or `... .blocks.N.`), else itself:
    the weights whose conversion reverts together."""
    match = re.match(r"(.*?\.(?:layers|blocks)\.\d+\.)", name)
    return match.group(1) if match else name


def _room_for(folders: list[Path], nbytes: int) -> Path:
    for folder in folders:
        if shutil.disk_usage(folder).free - nbytes >= MARGIN_BYTES:
            return folder
    free = ", ".join(f"{f}: {shutil.disk_usage(f).free / 2**30:.1f} GiB" for f in folders)
    raise OSError(
        f"no room for a shard of {nbytes / 2**30:.1f} GiB (free: {free}); name another folder "
        "with --spill"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omniflow.families.qwen3_omni.scaled",
        description="Build a random-weight Qwen3-Omni-30B-A3B-Instruct at real widths.",
    )
    parser.add_argument("--out", required=True, help="the checkpoint folder")
    parser.add_argument(
        "--spill",
        action="append",
        help="a folder for the shards that do not fit --out (repeatable; default "
        "/dev/shm/omniflow_scaled/NAME)",
    )
    parser.add_argument("--depth", type=float, default=1.0, help="x the real layer counts")
    parser.add_argument("--device", default="cuda", help="where to make the weights")
    parser.add_argument("--shard-gib", type=float, default=SHARD_BYTES / 2**30)
    args = parser.parse_args(argv)
    out = build_scaled(args.out, args.depth, args.device, args.spill, int(args.shard_gib * 2**30))
    print(out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())

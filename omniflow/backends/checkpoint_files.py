"""A checkpoint's own JSON files, and the architecture they declare.

A model backend asks the architecture registry (`omniflow.backends.registry.ARCHITECTURES`)
for a checkpoint's model-specific code by the names read here, from a local folder or the
Hugging Face cache alike, without loading a weight.
"""

from __future__ import annotations

import json

INDEX = "model_index.json"
CONFIG = "config.json"


def read_json(root: str, name: str, subfolder: str = "") -> dict | None:
    """`subfolder/name` of the checkpoint at `root` (a folder or a hub id), or None."""
    from transformers.utils import cached_file

    path = cached_file(
        root,
        name,
        subfolder=subfolder,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
    )
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def parts(index: dict) -> list[str]:
    """The parts a `model_index.json` names, each in a folder of its own."""
    return [name for name, entry in index.items() if isinstance(entry, list)]


def architecture(root: str) -> str | None:
    """The checkpoint's architecture: its `model_index.json`'s `_class_name` (a checkpoint
    of parts, such as tiny:tts), else its `config.json`'s `model_type`."""
    index = read_json(root, INDEX)
    if index is not None:
        return index.get("_class_name")
    return (read_json(root, CONFIG) or {}).get("model_type")


def part_architecture(root: str, component: str | None) -> str | None:
    """The architecture of the checkpoint's part `component`: the `model_type` of the
    part's own `config.json` where the checkpoint's index names it, else the checkpoint's."""
    index = read_json(root, INDEX)
    if index is not None and component in parts(index):
        return (read_json(root, CONFIG, component) or {}).get("model_type")
    return architecture(root)

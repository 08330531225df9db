"""A python stage whose load takes GPU memory: importing it allocates 64 MiB on the current
CUDA device (imported only by a GPU test, by dotted path, where the stage loads)."""

import torch

HELD = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")


def passthrough(batch):
    """tokens -> tokens, as they are."""
    return [{"out": item["in"]} for item in batch]

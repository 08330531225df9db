"""The kernels' launch options: programmatic dependent launch only where asked for and where
a CUDA device can take it (the `GDC` branch's code compiles for sm_90:
tests/kernels/test_moe_route.py)."""

import torch

from omniflow.kernels import triton_guard


def test_dependent_launch_is_off_by_default_and_off_the_gpu(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setattr(triton_guard, "PDL", False)
    assert triton_guard.dependent_launch(x) == {"GDC": False}
    monkeypatch.setattr(triton_guard, "PDL", True)
    assert triton_guard.dependent_launch(x) == {"GDC": False}  # a CPU tensor: nothing to launch

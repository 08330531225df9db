"""The kernels' launch options: programmatic dependent launch where a CUDA device can take
it (the `GDC` branch's code compiles for sm_90: tests/kernels/test_moe_route.py), and not
off the GPU, where the interpreter runs the kernels."""

import pytest
import torch

from omniflow.kernels import triton_guard


def test_dependent_launch_is_off_the_gpu():
    assert triton_guard.dependent_launch(torch.zeros(2)) == {"GDC": False}


@pytest.mark.gpu
def test_dependent_launch_is_on_from_hopper_on():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    hopper = torch.cuda.get_device_capability(0)[0] >= 9
    want = {"GDC": True, "launch_pdl": True} if hopper else {"GDC": False}
    assert triton_guard.dependent_launch(torch.zeros(2, device="cuda:0")) == want

"""The one dtype table: its sizes are torch's, and names and aliases map both ways."""

import pytest
import torch

from omniflow.dtypes import DTYPE_BYTES, STAGE_DTYPES, dtype_bytes, dtype_name, torch_dtype


def test_the_table_agrees_with_torch():
    for name, size in DTYPE_BYTES.items():
        assert torch_dtype(name).itemsize == size
        assert dtype_name(torch_dtype(name)) == name
    assert set(STAGE_DTYPES) <= set(DTYPE_BYTES)


def test_aliases_and_other_torch_dtypes():
    assert dtype_bytes("torch.bfloat16") == dtype_bytes("bf16") == 2
    assert torch_dtype("fp8") is torch.float8_e4m3fn
    # The data plane carries whatever a stage emits, beyond the table too.
    assert torch_dtype(dtype_name(torch.complex64)) is torch.complex64
    with pytest.raises(ValueError, match="unknown dtype 'float13'"):
        dtype_bytes("float13")
    with pytest.raises(ValueError, match="unknown dtype 'Size'"):
        torch_dtype("Size")

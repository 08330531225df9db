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


def test_a_cast_model_keeps_its_rotary_frequencies_float32_as_from_pretrained_does(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from omniflow.dtypes import cast_model

    # a head width of 128 and a RoPE base of 1e6, as Qwen3's
    config = Qwen3Config(vocab_size=64, hidden_size=256, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    theirs = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = cast_model(Qwen3ForCausalLM.from_pretrained(tmp_path), torch.bfloat16)
    plain = Qwen3ForCausalLM.from_pretrained(tmp_path).to(torch.bfloat16)
    assert ours.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    for name in ("inv_freq", "original_inv_freq"):
        want = getattr(theirs.model.rotary_emb, name)
        assert want.dtype == torch.float32
        assert torch.equal(getattr(ours.model.rotary_emb, name), want)
        assert getattr(plain.model.rotary_emb, name).dtype == torch.bfloat16
    # The angles at position 500: float32 frequencies against bf16-rounded ones.
    x = torch.zeros(1, 1, 256, dtype=torch.bfloat16)
    at = torch.tensor([[500]])
    cos_ours, _ = ours.model.rotary_emb(x, at)
    cos_theirs, _ = theirs.model.rotary_emb(x, at)
    cos_plain, _ = plain.model.rotary_emb(x, at)
    assert torch.equal(cos_ours, cos_theirs)
    assert float((cos_plain.float() - cos_theirs.float()).abs().max()) > 0.1
    rounded = plain.model.rotary_emb.inv_freq.float() - theirs.model.rotary_emb.inv_freq
    assert float(rounded.abs().max()) * 500 > 0.5  # radians off at position 500

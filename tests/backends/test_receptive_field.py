"""receptive_field's interval arithmetic: small layer stacks whose fields are worked out by hand,
and real torch modules against it. Changing one input position changes no output outside its
computed field: those outputs are computed from equal numbers, so they stay exactly equal.
What does change may fall short of the field (influence lost to rounding), never go beyond it.
The real decoders' walks are checked the same way in test_vocoders.py."""

import math

import pytest
import torch
from torch import nn
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAntiAliasedActivation1d,
    Qwen2_5OmniSnakeBeta,
)

from omniflow.backends import receptive_field as rf
from omniflow.backends.receptive_field import Field, ReceptiveFieldError

FRAME = Field(0, 0)


def test_a_centered_convolution_reaches_half_its_kernel_each_way():
    # Output o reads inputs o-1..o+1, so input 0 reaches outputs -1..1; two of them -2..2.
    assert rf.conv(FRAME, 3, padding=1) == Field(-1, 1)
    assert rf.conv(rf.conv(FRAME, 3, padding=1), 3, padding=1) == Field(-2, 2)
    # Dilation 2: o reads o-2, o, o+2.
    assert rf.conv(FRAME, 3, padding=2, dilation=2) == Field(-2, 2)


def test_a_causal_convolution_reaches_only_later_positions():
    # All kernel - 1 = 3 positions of padding on the left: o reads o-3..o.
    assert rf.conv(FRAME, 4, padding=3) == Field(0, 3)
    assert rf.conv(rf.shift(FRAME, 3), 4) == Field(0, 3)  # the same padding as a layer of its own


def test_upsampling_and_downsampling_keep_count_of_positions_per_frame():
    # Kernel 4, stride 2, padding 1: input 0 writes outputs 0*2 - 1 + i, i < 4.
    up = rf.conv_transpose(FRAME, 4, stride=2, padding=1)
    assert up == Field(-1, 2, per_frame=2)
    # Kernel 3, stride 2, padding 1: o reads 2o-1..2o+1; o = -1 reads -3..-1, o = 1 reads 1..3.
    assert rf.conv(up, 3, stride=2, padding=1) == Field(-1, 1, per_frame=1)


def test_a_stride_that_splits_frames_is_refused():
    with pytest.raises(ReceptiveFieldError, match="frames whole"):
        rf.conv(FRAME, 3, stride=2)


def test_summed_branches_reach_as_far_as_the_farthest():
    assert rf.union(FRAME, rf.conv(FRAME, 5, padding=2)) == Field(-2, 2)  # a residual
    assert rf.union(Field(-1, 4, min_frames=3), Field(-3, 0, min_frames=2)) == Field(
        -3, 4, min_frames=3
    )


def test_attention_and_recurrence_reach_later_positions():
    # A position sees itself and the 15 before it: position 3 is seen up to 18.
    assert rf.causal_attention(Field(0, 3), 16) == Field(0, 18)
    assert rf.causal_attention(FRAME, None) == Field(0, math.inf)
    remembered = rf.recurrent(FRAME)
    assert remembered == Field(0, math.inf)
    assert rf.conv_transpose(rf.conv(remembered, 3, padding=1), 4, stride=2) == Field(
        -2, math.inf, per_frame=2
    )
    assert rf.context(remembered) == math.inf and rf.lookahead(remembered) == 0


def test_reflect_padding_sets_the_shortest_input():
    # Reflecting 6 positions needs 7 of input: 7 frames at 1 position each, 1 frame at 8.
    assert rf.needs_more_than(FRAME, 6).min_frames == 7
    assert rf.needs_more_than(Field(0, 0, per_frame=8), 6).min_frames == 1
    assert rf.needs_more_than(Field(0, 0, per_frame=8), 8).min_frames == 2


def test_frames_of_lookahead_and_context():
    # Output frame f spans samples 240f..240f+239. Samples -4237 (in frame -18) to 4476 (in
    # frame 18) depend on input frame 0: output frames 18 before and 18 after it.
    field = Field(-4237, 4476, per_frame=240)
    assert (rf.lookahead(field), rf.context(field)) == (18, 18)
    # The frame's own samples only; one sample more either way is one frame more.
    assert (rf.lookahead(Field(0, 239, 240)), rf.context(Field(0, 239, 240))) == (0, 0)
    assert (rf.lookahead(Field(-1, 240, 240)), rf.context(Field(-1, 240, 240))) == (1, 1)


def test_the_anti_aliased_activation_reaches_five_positions_each_way():
    """Qwen2.5-Omni's BigVGAN activation: 2x upsampling filter, SnakeBeta, 2x downsampling
    filter, 12 taps each. Upsampling replicate-pads 5, transposes (input q writes 2q..2q+11)
    and trims 15: q reaches 2q-5..2q+6. Downsampling pads 5 and reads 2o..2o+11: 2q-5..2q+6 is
    read by o = q-5..q+5."""
    activation = Qwen2_5OmniAntiAliasedActivation1d(Qwen2_5OmniSnakeBeta(2))
    up, down = activation.upsample, activation.downsample
    assert (up.pad, up.pad_left, up.filter.shape[-1], down.pad_left, down.filter.shape[-1]) == (
        5,
        15,
        12,
        5,
        12,
    )
    upsampled = rf.shift(rf.conv_transpose(rf.shift(FRAME, 5), 12, stride=2), -15)
    assert upsampled == Field(-5, 6, per_frame=2)
    field = rf.conv(upsampled, 12, stride=2, padding=5)
    assert field == Field(-5, 5)
    assert_field_bounds_the_change(activation, field)


class Residual(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def test_a_conv_stack_read_from_its_modules():
    torch.manual_seed(0)
    first = nn.Conv1d(2, 4, 5, padding=2)
    up = nn.ConvTranspose1d(4, 4, 4, stride=2, padding=1)
    dilated = nn.Conv1d(4, 4, 3, dilation=3, padding=3)
    down = nn.Conv1d(4, 2, 3, stride=2, padding=1)
    stack = nn.Sequential(first, nn.Tanh(), up, Residual(nn.Sequential(nn.Tanh(), dilated)), down)
    field = rf.conv1d(FRAME, first)  # -2..2
    field = rf.conv_transpose1d(field, up)  # -2*2 - 1 = -5 .. 2*2 - 1 + 3 = 6, 2 per frame
    field = rf.union(field, rf.conv1d(field, dilated))  # -5 - 3 .. 6 + 3
    field = rf.conv1d(field, down)  # o reads 2o-1..2o+1: ceil(-9/2) .. floor(10/2)
    assert field == Field(-4, 5)
    assert_field_bounds_the_change(stack, field)


def assert_field_bounds_the_change(module: nn.Module, field: Field, length: int = 32) -> None:
    """Change input position length/2 of `module` (`[1, 2, length]` in, `[1, C, T]` out): every
    output outside `field` stays exactly equal, and some output within it changes."""
    position = length // 2
    x = torch.randn(1, 2, length, generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[..., position] += 1.0
    with torch.no_grad():
        before, after = module(x)[0], module(y)[0]
    relative = torch.arange(before.shape[-1]) - position * field.per_frame
    outside = (relative < field.first) | (relative > field.last)
    assert outside.any() and torch.equal(before[:, outside], after[:, outside])
    assert not torch.equal(before, after)

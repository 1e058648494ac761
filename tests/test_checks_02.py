"""Chapter 02's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import attention, checks, positional


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_heads(attention.split_heads, attention.merge_heads)
    checks.check_multi_head_attention(attention.MultiHeadAttention)
    checks.check_sinusoidal_encoding(positional.sinusoidal_encoding)
    checks.check_apply_rope(positional.apply_rope)
    assert capsys.readouterr().out.count("all visible checks passed") == 4


def split_without_transpose(x, n_heads):
    batch, time, d_model = x.shape
    return x.reshape(batch, n_heads, time, d_model // n_heads)


def merge_view_without_contiguous(x):
    batch, n_heads, time, d_head = x.shape
    return x.transpose(1, 2).view(batch, time, n_heads * d_head)


def merge_without_transpose(x):
    batch, n_heads, time, d_head = x.shape
    return x.reshape(batch, time, n_heads * d_head)


class ScaledByDModel(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        q, k, v = (attention.split_heads(W(t), self.n_heads) for W, t in ((self.W_q, query), (self.W_k, key), (self.W_v, value)))
        weights = attention.masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(self.d_model), mask)
        return self.W_o(attention.merge_heads(weights @ v)), weights


class Unscaled(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        q, k, v = (attention.split_heads(W(t), self.n_heads) for W, t in ((self.W_q, query), (self.W_k, key), (self.W_v, value)))
        weights = attention.masked_softmax(q @ k.transpose(-2, -1), mask)
        return self.W_o(attention.merge_heads(weights @ v)), weights


class OutputOnly(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        return super().forward(query, key, value, mask)[0]


def sinusoidal_swapped(max_len, d_model):
    return positional.sinusoidal_encoding(max_len, d_model).view(max_len, -1, 2).flip(-1).flatten(1)


def sinusoidal_sines_first(max_len, d_model):
    table = positional.sinusoidal_encoding(max_len, d_model)
    return torch.cat((table[:, 0::2], table[:, 1::2]), dim=-1)


def rope_rotate_half(x, positions=None, base=10000.0):
    half = x.shape[-1] // 2
    angle = torch.arange(x.shape[-2])[:, None] * base ** (-torch.arange(half) * 2 / x.shape[-1])
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def rope_not_a_rotation(x, positions=None, base=10000.0):
    angle = torch.arange(x.shape[-2])[:, None] * base ** (-torch.arange(0, x.shape[-1], 2) / x.shape[-1])
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * angle.cos() + odd * angle.sin(), even * angle.sin() + odd * angle.cos()), dim=-1).flatten(-2)


def rope_clockwise(x, positions=None, base=10000.0):
    return positional.apply_rope(x, -torch.arange(x.shape[-2]), base)


def rope_ignoring_positions(x, positions=None, base=10000.0):
    return positional.apply_rope(x, None, base)


@pytest.mark.parametrize("call,message", [
    (lambda: checks.check_apply_rope(rope_ignoring_positions), r"ignores `positions`"),
    (lambda: checks.check_heads(split_without_transpose, attention.merge_heads), r"looks like x\.view\(B, H, T, Dh\): that mixes positions and heads"),
    (lambda: checks.check_heads(attention.split_heads, merge_view_without_contiguous),
     r"merge_heads raised RuntimeError: view size is not compatible.*call \.contiguous\(\) first, or use \.reshape\(\)"),
    (lambda: checks.check_heads(attention.split_heads, merge_without_transpose), r"looks like y\.reshape\(B, T, H\*Dh\) without swapping"),
    (lambda: checks.check_multi_head_attention(ScaledByDModel), r"scores scaled by 0\.25; the expected scale is 1/sqrt\(d_head\) = 1/sqrt\(16/4\) = 0\.5"),
    (lambda: checks.check_multi_head_attention(Unscaled), r"scores scaled by 1; the expected scale is 1/sqrt\(d_head\)"),
    (lambda: checks.check_multi_head_attention(OutputOnly), r"should return a tuple \(out, weights\), got Tensor"),
    (lambda: checks.check_sinusoidal_encoding(sinusoidal_swapped), r"row 0 \(position 0\) of your table is \[1\.0, 0\.0, .*sin and cos are swapped"),
    (lambda: checks.check_sinusoidal_encoding(sinusoidal_sines_first), r"all sines first, then all cosines"),
    (lambda: checks.check_apply_rope(rope_rotate_half), r"paired feature i with feature i \+ Dh/2"),
    (lambda: checks.check_apply_rope(rope_not_a_rotation), r"changed the length of a vector by up to \d\.\d+"),
    (lambda: checks.check_apply_rope(rope_clockwise), r"your rotation goes the wrong way"),
])
def test_classic_bugs_get_specific_messages(call, message):
    with pytest.raises(checks.CheckFailed, match=message):
        call()

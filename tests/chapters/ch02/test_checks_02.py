"""Chapter 02's learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import attention, checks, positional


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


def _mha_variant(**changes):
    """A MultiHeadAttention whose forward has one classic mistake (given as keyword switches)."""
    class Variant(attention.MultiHeadAttention):
        def forward(self, query, key, value, mask=None):
            if changes.get("keys_from_query"):
                key = value = query
            W_k, W_v = (self.W_v, self.W_k) if changes.get("kv_projections_swapped") else (self.W_k, self.W_v)
            q = attention.split_heads(self.W_q(query), self.n_heads)
            k = attention.split_heads(W_k(key), self.n_heads)
            v = attention.split_heads(W_v(key if changes.get("values_from_key") else value), self.n_heads)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
            if changes.get("transposed"):
                scores = scores.transpose(-2, -1)
            if changes.get("mask") == "ignored":
                mask = None
            elif changes.get("mask") == "inverted" and mask is not None:
                mask = ~mask
            weights = torch.softmax(scores, dim=-2) if changes.get("softmax_over_queries") else attention.masked_softmax(scores, mask)
            if changes.get("mask_after_softmax"):
                weights = torch.softmax(scores, dim=-1) * (True if mask is None else mask)
            heads = weights @ v
            merged = heads.view(query.shape) if changes.get("merge_by_view") else attention.merge_heads(heads)
            return (merged if changes.get("no_output_projection") else self.W_o(merged)), weights
    return Variant


def sinusoidal_with(frequency):
    def sinusoidal_encoding(max_len, d_model):
        table = torch.zeros(max_len, d_model)
        for pos in range(max_len):
            for j in range(d_model):
                angle = pos * frequency(j, d_model)
                table[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
        return table
    return sinusoidal_encoding


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


class NoValueError(attention.MultiHeadAttention):
    def __init__(self, d_model, n_heads, dropout=0.0, bias=True):
        super().__init__(d_model - d_model % n_heads, n_heads, dropout, bias)  # builds something instead of refusing


class NegInfFill(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        q, k, v = (attention.split_heads(W(t), self.n_heads) for W, t in ((self.W_q, query), (self.W_k, key), (self.W_v, value)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, -1)
        return self.W_o(attention.merge_heads(weights @ v)), weights


class AlwaysBias(attention.MultiHeadAttention):
    def __init__(self, d_model, n_heads, dropout=0.0, bias=True):
        super().__init__(d_model, n_heads, dropout)  # issue 41: bias=False still builds the biases (4 D^2 + 4 D parameters)


class HeadAveraged(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        out, weights = super().forward(query, key, value, mask)
        return out, weights.mean(1)  # issue 41: nn.MultiheadAttention's default, one map for all heads


class HeadAveragedKeepdim(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        out, weights = super().forward(query, key, value, mask)
        return out, weights.mean(1, keepdim=True)  # averaged, the head axis kept as 1: (B, 1, Tq, Tk)


class KeyValueSwapped(attention.MultiHeadAttention):
    def forward(self, query, key, value, mask=None):
        return super().forward(query, value, key, mask)


def rope_with_theta(theta=None, shift=0):
    """The tester's RoPE with a wrong theta (a function of Dh and base) or positions shifted by `shift`."""
    def apply_rope(x, positions=None, base=10000.0):
        d_head, time = x.shape[-1], x.shape[-2]
        positions = torch.arange(time) if positions is None else positions
        frequencies = (theta or (lambda d, b: b ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)))(d_head, base)
        angle = (positions + shift).to(torch.float64)[..., None] * frequencies
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)
    return apply_rope


def rope_base_ignored(x, positions=None, base=10000.0):
    return positional.apply_rope(x, positions)


def rope_positions_flattened(x, positions=None, base=10000.0):
    time = x.shape[-2]
    positions = torch.arange(time) if positions is None else positions
    return positional.apply_rope(x, positions.reshape(-1)[-time:], base)


@pytest.mark.parametrize("call,message", [
    (lambda: checks.check_multi_head_attention(NegInfFill),
     r"leaves query 1 of batch element 1 no key at all, your weights for that query hold 24 NaN.*0/0 = NaN.*masked_softmax"),
    (lambda: checks.check_multi_head_attention(KeyValueSwapped), r"keys come from `value` and your values from `key`: the roles are swapped"),
    (lambda: checks.check_apply_rope(rope_base_ignored), r"apply_rope\(x, base=100\.0\) gives the same result as apply_rope\(x\): `base` is ignored"),
    (lambda: checks.check_apply_rope(rope_positions_flattened), r"positions \(2, 1, 5\).*rotates sequence 0 by the other sequence's positions"),
    (lambda: checks.check_apply_rope(rope_with_theta(lambda d, b: b ** (-torch.arange(d // 2, dtype=torch.float64) / d))),
     r"wrong angles: theta_i = 10000\^\(-i/Dh\) with i the pair index"),
    (lambda: checks.check_apply_rope(rope_with_theta(lambda d, b: b ** (-torch.arange(0, 2 * d, 4, dtype=torch.float64) / d))),
     r"wrong angles: theta_i = 10000\^\(-4i/Dh\)"),
    (lambda: checks.check_apply_rope(rope_with_theta(lambda d, b: b ** (-torch.arange(0, d, 2, dtype=torch.float64).flip(0) / d))),
     r"wrong angles: your frequencies are reversed"),
    (lambda: checks.check_apply_rope(rope_with_theta(shift=1)), r"wrong angles: your positions start at 1"),
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
    (lambda: checks.check_sinusoidal_encoding(sinusoidal_with(lambda j, d: 10000 ** (-(j // 2) / d))),
     r"wrong frequencies: you divide pos by 10000\^\(i/d\) with i the pair index\. The exponent is 2i/d"),
    (lambda: checks.check_sinusoidal_encoding(sinusoidal_with(lambda j, d: 10000 ** (-j / d))),
     r"wrong frequencies: you divide pos by 10000\^\(j/d\) with j each column's own index"),
    (lambda: checks.check_sinusoidal_encoding(sinusoidal_with(lambda j, d: 10000 ** (2 * (j // 2) / d))),
     r"wrong frequencies: you multiply pos by 10000\^\(2i/d\)"),
    (lambda: checks.check_sinusoidal_encoding(sinusoidal_with(lambda j, d: 1000 ** (-2 * (j // 2) / d))),
     r"column 2 \(sin of pair i = 1\) of sinusoidal_encoding\(6, 8\) is wrong: at position 1 it holds 0\.17\d+, the sine of"),
    (lambda: checks.check_multi_head_attention(_mha_variant(softmax_over_queries=True)), r"softmax over the queries \(dim=-2\)"),
    (lambda: checks.check_multi_head_attention(_mha_variant(transposed=True)), r"your weights are transposed"),
    (lambda: checks.check_multi_head_attention(_mha_variant(no_output_projection=True)), r"without the output projection"),
    (lambda: checks.check_multi_head_attention(_mha_variant(mask="inverted")), r"your mask is inverted"),
    (lambda: checks.check_multi_head_attention(_mha_variant(mask="ignored")), r"the mask never reaches the softmax"),
    (lambda: checks.check_multi_head_attention(_mha_variant(values_from_key=True)), r"your output uses `key` as the values"),
    (lambda: checks.check_multi_head_attention(_mha_variant(merge_by_view=True)), r"heads are merged in the wrong order: .*Transpose back"),
    (lambda: checks.check_multi_head_attention(_mha_variant(mask_after_softmax=True)), r"masked keys zeroed afterwards: .*masked_softmax\(scores, mask\)"),
    (lambda: checks.check_multi_head_attention(_mha_variant(kv_projections_swapped=True)), r"keys are projected with W_v .*swapped"),
    (lambda: checks.check_multi_head_attention(NoValueError), r"MultiHeadAttention\(10, 4\) built a module: 4 heads do not divide d_model = 10"),
    (lambda: checks.check_multi_head_attention(_mha_variant(keys_from_query=True)), r"raised RuntimeError: .*keys come from `key`, values from `value`"),
    (lambda: checks.check_multi_head_attention(AlwaysBias),
     r"MultiHeadAttention\(16, 4, bias=False\) has 1,088 parameters, expected 4 D\^2 = 1,024 .*W_q, W_k, W_v, W_o still have biases"),
    (lambda: checks.check_multi_head_attention(HeadAveraged), r"shape \(2, 5, 5\) = \(B, Tq, Tk\), one map for all 4 heads: they look averaged"),
    (lambda: checks.check_multi_head_attention(HeadAveragedKeepdim),
     r"shape \(2, 1, 5, 5\) = \(B, 1, Tq, Tk\), one map for all 4 heads: they look averaged"),
    (lambda: checks.check_apply_rope(rope_rotate_half), r"paired feature i with feature i \+ Dh/2"),
    (lambda: checks.check_apply_rope(rope_not_a_rotation), r"changed the length of a vector by up to \d\.\d+"),
    (lambda: checks.check_apply_rope(rope_clockwise), r"your rotation goes the wrong way"),
])
def test_classic_bugs_get_specific_messages(call, message):
    with pytest.raises(checks.CheckFailed, match=message):
        call()

"""course_lib.attention against independent oracles: PyTorch built-ins and float64 formulas."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.attention import AdditiveAttention, additive_attention, masked_softmax, scaled_dot_product_attention
from tests.helpers import assert_parity


def random_mask(shape, generator, keep=0.6):
    mask = torch.rand(shape, generator=generator) < keep
    mask[..., 0] = True  # no fully masked rows here; they have their own tests
    return mask


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 4, 6), (2, 3, 4, 5)])
def test_masked_softmax_without_mask_is_softmax(shape, generator):
    scores = torch.randn(shape, generator=generator) * 4
    assert_parity(masked_softmax(scores), torch.softmax(scores.double(), dim=-1))


@pytest.mark.parametrize("mask_shape", [(2, 3, 4, 5), (2, 1, 1, 5), (1, 1, 4, 5), (5,)])
def test_masked_softmax_matches_float64_softmax_over_kept_keys(mask_shape, generator):
    scores = torch.randn(2, 3, 4, 5, generator=generator) * 3
    mask = random_mask(mask_shape, generator)
    expected = torch.softmax(scores.double().masked_fill(~mask, -math.inf), dim=-1)
    out = masked_softmax(scores, mask)
    assert_parity(out, expected)
    assert (out.masked_fill(mask, 0) == 0).all()


def test_masked_softmax_fully_masked_rows_are_zero_with_finite_gradient(generator):
    scores = torch.randn(4, 6, generator=generator, requires_grad=True)
    mask = random_mask((4, 6), generator)
    mask[1] = False
    out = masked_softmax(scores, mask)
    assert torch.equal(out[1], torch.zeros(6))
    assert torch.isfinite(out).all()
    (out * torch.randn(4, 6, generator=generator)).sum().backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_masked_softmax_uses_a_finite_fill_for_every_dtype(dtype):
    scores = torch.zeros(2, 3, dtype=dtype)
    mask = torch.tensor([[True, False, False], [False, False, False]])
    out = masked_softmax(scores, mask)
    assert out.dtype == dtype
    assert torch.equal(out.float(), torch.tensor([[1.0, 0, 0], [0, 0, 0]]))


@pytest.mark.parametrize("q_shape,k_len,d_v", [((4, 8), 6, 3), ((2, 5, 16), 7, 16), ((2, 3, 5, 8), 9, 4)])
def test_sdpa_matches_pytorch(q_shape, k_len, d_v, generator):
    *lead, t_q, d_k = q_shape
    q = torch.randn(q_shape, generator=generator)
    k = torch.randn(*lead, k_len, d_k, generator=generator)
    v = torch.randn(*lead, k_len, d_v, generator=generator)
    mask = random_mask((*lead, t_q, k_len), generator)
    for m in (None, mask):
        out, weights = scaled_dot_product_attention(q, k, v, m)
        assert_parity(out, F.scaled_dot_product_attention(q, k, v, attn_mask=m))
        scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(d_k)
        if m is not None:
            scores = scores.masked_fill(~m, -math.inf)
        assert_parity(weights, torch.softmax(scores, dim=-1))


def test_sdpa_with_causal_mask_matches_is_causal(generator):
    q, k, v = (torch.randn(2, 4, 6, 8, generator=generator) for _ in range(3))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    out, _ = scaled_dot_product_attention(q, k, v, causal)
    assert_parity(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_sdpa_fully_masked_rows_match_pytorch_zeros(generator):
    q, k, v = torch.randn(2, 3, 8, generator=generator), torch.randn(2, 4, 8, generator=generator), torch.randn(2, 4, 5, generator=generator)
    mask = torch.tensor([[True, True, False, False], [False] * 4]).view(2, 1, 4)
    out, weights = scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[1], torch.zeros(3, 5)) and torch.equal(weights[1], torch.zeros(3, 4))
    assert_parity(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask).nan_to_num(0.0))


def additive_oracle(query, keys, values, W_q, W_k, v, mask=None):
    """Bahdanau's formula, one (i, j) pair at a time, in float64 (2-D inputs)."""
    energies = torch.empty(query.shape[0], keys.shape[0], dtype=torch.float64)
    for i in range(query.shape[0]):
        for j in range(keys.shape[0]):
            energies[i, j] = v.double() @ torch.tanh(W_q.double().T @ query[i].double() + W_k.double().T @ keys[j].double())
    if mask is not None:
        energies = energies.masked_fill(~mask, -math.inf)
    weights = torch.softmax(energies, dim=-1)
    return weights @ values.double(), weights


@pytest.mark.parametrize("with_mask", [False, True])
def test_additive_attention_matches_the_paper_formula(with_mask, generator):
    query, keys, values = torch.randn(3, 4, generator=generator), torch.randn(5, 6, generator=generator), torch.randn(5, 2, generator=generator)
    W_q, W_k, v = torch.randn(4, 7, generator=generator), torch.randn(6, 7, generator=generator), torch.randn(7, generator=generator)
    mask = random_mask((3, 5), generator) if with_mask else None
    context, weights = additive_attention(query, keys, values, W_q, W_k, v, mask)
    expected_context, expected_weights = additive_oracle(query, keys, values, W_q, W_k, v, mask)
    assert_parity(weights, expected_weights)
    assert_parity(context, expected_context)


def test_additive_attention_batches_like_slices(generator):
    query, keys, values = torch.randn(2, 3, 4, 5, generator=generator), torch.randn(2, 3, 6, 7, generator=generator), torch.randn(2, 3, 6, 2, generator=generator)
    module = AdditiveAttention(5, 7, 8)
    context, weights = module(query, keys, values)
    assert context.shape == (2, 3, 4, 2) and weights.shape == (2, 3, 4, 6)
    for b in range(2):
        for h in range(3):
            expected_context, expected_weights = additive_oracle(query[b, h], keys[b, h], values[b, h], module.W_q.detach(), module.W_k.detach(), module.v.detach())
            assert_parity(context[b, h].detach(), expected_context)


@pytest.mark.parametrize("args", [(0, 4, 4), (4, -1, 4), (4, 4, 0)])
def test_additive_attention_module_rejects_bad_sizes(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        AdditiveAttention(*args)

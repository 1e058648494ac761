"""course_lib.attention's chapter 02 part (split/merge heads, MultiHeadAttention) against PyTorch oracles."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib.attention import MultiHeadAttention, merge_heads, split_heads
from course_lib.checks import torch_multihead_attention
from tests.helpers import assert_parity


def randomized(d_model, n_heads, generator, bias=True, dropout=0.0):
    module = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return module


# --- split / merge ----------------------------------------------------------------------------

@pytest.mark.parametrize("n_heads", [1, 2, 3, 6])
def test_split_heads_gives_head_h_the_columns_of_chunk_h(n_heads, generator):
    x = torch.randn(2, 5, 12, generator=generator)
    heads = split_heads(x, n_heads)
    assert heads.shape == (2, n_heads, 5, 12 // n_heads)
    assert torch.equal(heads, torch.stack(x.chunk(n_heads, dim=-1), dim=1))


@pytest.mark.parametrize("n_heads", [1, 2, 4])
def test_merge_heads_concatenates_heads_in_order_and_inverts_split(n_heads, generator):
    y = torch.randn(3, n_heads, 5, 4, generator=generator)
    merged = merge_heads(y)
    assert merged.is_contiguous() and torch.equal(merged, torch.cat(y.unbind(dim=1), dim=-1))
    x = torch.randn(3, 5, 4 * n_heads, generator=generator)
    assert torch.equal(merge_heads(split_heads(x, n_heads)), x)


def test_split_and_merge_accept_non_contiguous_inputs(generator):
    x = torch.randn(5, 2, 8, generator=generator).transpose(0, 1)  # (B, T, D) from a seq-first tensor
    assert not x.is_contiguous()
    assert torch.equal(split_heads(x, 4), split_heads(x.contiguous(), 4))
    y = torch.randn(2, 4, 3, 5, generator=generator).transpose(2, 3)  # (B, H, T, Dh), not contiguous
    assert torch.equal(merge_heads(y), merge_heads(y.contiguous())) and merge_heads(y).is_contiguous()


def test_split_and_merge_match_the_folding_inside_nn_multihead_attention(generator):
    """PyTorch folds heads into the batch as (B*H, T, Dh); our (B, H, T, Dh) is the same memory order."""
    x = torch.randn(2, 5, 12, generator=generator)
    torch_layout = x.transpose(0, 1).reshape(5, 2 * 3, 4).transpose(0, 1)  # what F.multi_head_attention_forward does
    assert torch.equal(split_heads(x, 3).reshape(6, 5, 4), torch_layout)


@pytest.mark.parametrize("shape,n_heads,match", [((2, 3, 10), 4, r"last dimension of x \(10\) must be divisible by n_heads, got n_heads=4"),
                                                  ((2, 3, 8), 0, r"got n_heads=0"),
                                                  ((3, 8), 2, r"x must have shape \(B, T, D\), got \(3, 8\)")])
def test_split_heads_rejects_bad_arguments(shape, n_heads, match):
    with pytest.raises(ValueError, match=match):
        split_heads(torch.zeros(shape), n_heads)


def test_merge_heads_rejects_a_3d_tensor():
    with pytest.raises(ValueError, match=r"x must have shape \(B, H, T, Dh\), got \(2, 3, 4\)"):
        merge_heads(torch.zeros(2, 3, 4))


# --- MultiHeadAttention against nn.MultiheadAttention -------------------------------------------

@pytest.mark.parametrize("d_model,n_heads,bias", [(16, 1, True), (16, 4, True), (24, 3, False), (32, 8, True)])
def test_self_attention_matches_nn_multihead_attention(d_model, n_heads, bias, generator):
    module = randomized(d_model, n_heads, generator, bias=bias)
    x = torch.randn(3, 7, d_model, generator=generator)
    out, weights = module(x, x, x)
    expected_out, expected_weights = torch_multihead_attention(module)(x, x, x, average_attn_weights=False)
    assert weights.shape == (3, n_heads, 7, 7)
    assert_parity(out, expected_out)
    assert_parity(weights, expected_weights)


def test_cross_attention_with_padding_mask_matches_nn_multihead_attention(generator):
    module = randomized(16, 4, generator)
    query, key, value = (torch.randn(2, 3, 16, generator=generator), torch.randn(2, 6, 16, generator=generator),
                         torch.randn(2, 6, 16, generator=generator))
    keep = torch.arange(6) < torch.tensor([[6], [4]])  # (B, Tk): batch 1 has 2 padding keys
    out, weights = module(query, key, value, keep.view(2, 1, 1, 6))
    # nn.MultiheadAttention's key_padding_mask is True where a key is padding: the opposite of ours
    expected_out, expected_weights = torch_multihead_attention(module)(query, key, value, key_padding_mask=~keep, average_attn_weights=False)
    assert weights.shape == (2, 4, 3, 6) and out.shape == (2, 3, 16)
    assert_parity(out, expected_out)
    assert_parity(weights, expected_weights)
    assert torch.equal(weights[1, :, :, 4:], torch.zeros(4, 3, 2))


@pytest.mark.parametrize("mask_shape", [(5, 5), (1, 1, 5, 5)])
def test_causal_mask_matches_nn_multihead_attention_with_the_inverted_mask(mask_shape, generator):
    module = randomized(16, 2, generator)
    x = torch.randn(2, 5, 16, generator=generator)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    out, weights = module(x, x, x, causal.view(mask_shape))
    expected_out, expected_weights = torch_multihead_attention(module)(x, x, x, attn_mask=~causal, average_attn_weights=False)
    assert_parity(out, expected_out)
    assert_parity(weights, expected_weights)
    # passing our mask unchanged would be the classic trap: the result is far off
    trapped, _ = torch_multihead_attention(module)(x, x, x, attn_mask=causal)
    assert (trapped.nan_to_num(0) - out).abs().max() > 1e-2


def test_matches_f_scaled_dot_product_attention_on_the_projections(generator):
    module = randomized(32, 4, generator)
    x = torch.randn(2, 6, 32, generator=generator)
    keep = (torch.arange(6) < torch.tensor([[6], [3]])).view(2, 1, 1, 6)
    out, _ = module(x, x, x, keep)
    q, k, v = (torch.stack(W(x).chunk(4, dim=-1), dim=1) for W in (module.W_q, module.W_k, module.W_v))
    heads = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # same mask convention: True = attend
    assert_parity(out, module.W_o(torch.cat(heads.unbind(dim=1), dim=-1)))


def test_scale_is_one_over_sqrt_d_head(generator):
    module = randomized(32, 8, generator)
    x = torch.randn(1, 4, 32, generator=generator)
    _, weights = module(x, x, x)
    q = torch.stack(module.W_q(x).double().chunk(8, dim=-1), dim=1)
    k = torch.stack(module.W_k(x).double().chunk(8, dim=-1), dim=1)
    assert_parity(weights, torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(4), dim=-1))


def test_gradients_match_nn_multihead_attention(generator):
    module = randomized(16, 4, generator)
    oracle = torch_multihead_attention(module)
    x = torch.randn(2, 5, 16, generator=generator)
    upstream = torch.randn(2, 5, 16, generator=generator)
    (module(x, x, x)[0] * upstream).sum().backward()
    (oracle(x, x, x)[0] * upstream).sum().backward()
    assert_parity(module.W_o.weight.grad, oracle.out_proj.weight.grad)
    ours = torch.cat([module.W_q.weight.grad, module.W_k.weight.grad, module.W_v.weight.grad])
    assert_parity(ours, oracle.in_proj_weight.grad)


def test_fully_masked_batch_element_gives_the_output_bias_and_finite_gradients(generator):
    module = randomized(16, 4, generator)
    x = torch.randn(2, 3, 16, generator=generator, requires_grad=True)
    keep = torch.tensor([[True, True, False], [False, False, False]]).view(2, 1, 1, 3)
    out, weights = module(x, x, x, keep)
    assert torch.equal(weights[1], torch.zeros(4, 3, 3))
    assert_parity(out[1], module.W_o.bias.expand(3, 16))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_dropout_acts_on_the_weights_in_training_only_and_matches_pytorch(generator):
    module = randomized(16, 4, generator, dropout=0.5)
    oracle = torch_multihead_attention(module, dropout=0.5)
    x = torch.randn(2, 5, 16, generator=generator)
    module.eval()
    assert_parity(module(x, x, x)[0], torch_multihead_attention(module)(x, x, x)[0])
    module.train(), oracle.train()
    torch.manual_seed(3)
    out, weights = module(x, x, x)
    torch.manual_seed(3)
    expected, _ = oracle(x, x, x)
    # same number of dropout draws in the same order: PyTorch's dropout mask is ours
    assert_parity(out, expected)
    assert_parity(weights.sum(-1), torch.ones(2, 4, 5))  # returned weights are those before dropout


@pytest.mark.parametrize("args,match", [((10, 4), r"d_model=10 and n_heads=4"), ((8, 0), r"d_model=8 and n_heads=0"),
                                        ((0, 1), r"d_model=0"), ((8, 2, 1.0), r"dropout must be in \[0, 1\), got 1.0")])
def test_constructor_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(*args)


def test_float_masks_are_rejected_with_the_convention_spelled_out():
    module = MultiHeadAttention(8, 2)
    x = torch.zeros(1, 3, 8)
    with pytest.raises(ValueError, match=r"mask must be a bool tensor \(True = attend\), got dtype torch.float32"):
        module(x, x, x, torch.zeros(3, 3))

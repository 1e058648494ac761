"""course_lib.layers against independent oracles: torch.nn.LayerNorm, F.layer_norm and float64 formulas."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from course_lib.layers import FeedForward, LayerNorm, layer_norm
from tests.helpers import assert_parity


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 4, 16), (2, 3, 4, 64)])
def test_layer_norm_matches_pytorch_and_the_float64_formula(shape, generator):
    x = torch.randn(shape, generator=generator) * 3 + 1
    d = shape[-1]
    weight, bias = torch.randn(d, generator=generator), torch.randn(d, generator=generator)
    out = layer_norm(x, weight, bias)
    assert_parity(out, F.layer_norm(x, (d,), weight, bias, eps=1e-5))
    x64 = x.double()
    centred = x64 - x64.mean(-1, keepdim=True)
    expected = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * weight.double() + bias.double()
    assert_parity(out, expected)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 1e-2])
@pytest.mark.parametrize("scale", [1e-4, 1.0, 100.0])
def test_layer_norm_eps_inside_the_square_root(eps, scale, generator):
    x = torch.randn(4, 8, generator=generator) * scale
    assert_parity(layer_norm(x, torch.ones(8), torch.zeros(8), eps=eps), F.layer_norm(x, (8,), eps=eps))


def test_layer_norm_of_a_constant_vector_is_the_bias():
    bias = torch.arange(6.0)
    assert torch.equal(layer_norm(torch.full((2, 6), 5.0), torch.ones(6), bias), bias.expand(2, 6))


def test_layer_norm_module_matches_nn_layer_norm_forward_and_backward(generator):
    ours, theirs = LayerNorm(12), nn.LayerNorm(12)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(12, generator=generator))
        ours.bias.copy_(torch.randn(12, generator=generator))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 5, 12, generator=generator)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    upstream = torch.randn(3, 5, 12, generator=generator)
    out, expected = ours(x_ours), theirs(x_theirs)
    assert_parity(out, expected.detach())
    (out * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert_parity(x_ours.grad, x_theirs.grad)
    assert_parity(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-4)  # a sum over 15 vectors: atol scales with it
    assert_parity(ours.bias.grad, theirs.bias.grad, rtol=1e-5, atol=1e-4)


def test_layer_norm_module_starts_as_pure_normalisation():
    module = LayerNorm(5)
    assert torch.equal(module.weight, torch.ones(5)) and torch.equal(module.bias, torch.zeros(5)) and module.eps == 1e-5


def test_feed_forward_matches_the_formula_and_is_position_wise(generator):
    torch.manual_seed(0)
    ffn = FeedForward(8, 32)
    x = torch.randn(2, 6, 8, generator=generator)
    W1, b1, W2, b2 = (p.detach().double() for p in (ffn.linear1.weight, ffn.linear1.bias, ffn.linear2.weight, ffn.linear2.bias))
    expected = torch.relu(x.double() @ W1.T + b1) @ W2.T + b2
    out = ffn(x)
    assert_parity(out, expected)
    for t in range(6):
        assert_parity(ffn(x[:, t]), out[:, t])
    assert sum(p.numel() for p in ffn.parameters()) == 2 * 8 * 32 + 32 + 8


def test_feed_forward_gelu_and_dropout_off_in_eval(generator):
    torch.manual_seed(0)
    ffn = FeedForward(8, 16, dropout=0.5, activation="gelu").eval()
    x = torch.randn(3, 8, generator=generator)
    expected = ffn.linear2(F.gelu(ffn.linear1(x)))
    assert_parity(ffn(x), expected)
    ffn.train()
    assert not torch.allclose(ffn(x), expected)


@pytest.mark.parametrize("make,match", [
    (lambda: FeedForward(0, 4), "d_model must be an integer >= 1"),
    (lambda: FeedForward(4, 0), "d_ff must be an integer >= 1"),
    (lambda: FeedForward(4, 8, dropout=1.0), r"dropout must be in \[0, 1\)"),
    (lambda: FeedForward(4, 8, activation="tanh"), "activation must be 'relu' or 'gelu'"),
    (lambda: LayerNorm(0), "d_model must be an integer >= 1"),
    (lambda: LayerNorm(4, eps=-1e-5), "eps must be >= 0"),
])
def test_bad_arguments_raise_clear_value_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_layer_norm_module_rejects_the_wrong_feature_size():
    with pytest.raises(ValueError, match=r"size 4 in its last axis, got shape \(2, 5\)"):
        LayerNorm(4)(torch.zeros(2, 5))

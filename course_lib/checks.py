"""Learner-facing checks: the visible test cells call these for instant, specific feedback.

A failed check raises ``CheckFailed`` (an ``AssertionError``) whose message says what is
wrong, with numbers: "row 2 of your weights sums to 0.87, expected 1". Expected values
come from independent oracles (PyTorch built-ins or a float64 formula), never from
``course_lib``'s own reference solutions.

Tolerance policy, used everywhere in the course: float32 parity is checked with
``rtol = atol = 1e-5`` unless a check says why it needs more.
"""
from __future__ import annotations

import math

import torch

RTOL = 1e-5
ATOL = 1e-5


class CheckFailed(AssertionError):
    """A check found a specific, explained problem in the learner's code."""


def _fail(message: str):
    raise CheckFailed(message)


def _index(flat_index: int, shape) -> tuple:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(shape)))


def assert_tensor(value, name: str) -> torch.Tensor:
    """The value is a torch.Tensor (not a tuple, None or ndarray)."""
    if not isinstance(value, torch.Tensor):
        _fail(f"{name} should be a torch.Tensor, got {type(value).__name__}")
    return value


def assert_shape(value, expected_shape, name: str) -> None:
    """The tensor has exactly the expected shape."""
    assert_tensor(value, name)
    if tuple(value.shape) != tuple(expected_shape):
        _fail(f"{name} has shape {tuple(value.shape)}, expected {tuple(expected_shape)}")


def assert_finite(value, name: str) -> None:
    """No NaN or infinity anywhere in the tensor."""
    assert_tensor(value, name)
    bad = ~torch.isfinite(value)
    if bad.any():
        where = _index(int(bad.flatten().nonzero()[0]), value.shape)
        _fail(f"{name} contains {int(bad.sum())} non-finite value(s), the first at index {where}: {value[where].item()}")


def assert_close(actual, expected, name: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """actual matches expected within the course tolerance; the message names the worst entry."""
    assert_tensor(actual, name)
    expected = expected.to(actual.dtype) if actual.is_floating_point() else expected
    assert_shape(actual, expected.shape, name)
    assert_finite(actual, name)
    error = (actual.double() - expected.double()).abs()
    allowed = atol + rtol * expected.double().abs()
    if (error > allowed).any():
        worst = _index(int((error - allowed).flatten().argmax()), actual.shape)
        _fail(
            f"{name} differs from the expected values in {int((error > allowed).sum())} of {error.numel()} entries; "
            f"the worst is at index {worst}: got {actual[worst].item():.6g}, expected {expected[worst].item():.6g} "
            f"(tolerance rtol={rtol:g}, atol={atol:g})"
        )


def assert_rows_sum_to_one(weights, name: str = "your weights", mask=None) -> None:
    """Each row along the last axis sums to 1 (rows with no unmasked key must sum to 0)."""
    sums = weights.double().sum(-1)
    expected = torch.ones_like(sums)
    if mask is not None:
        expected = mask.expand(weights.shape).any(-1).double()
    bad = (sums - expected).abs() > 1e-4
    if bad.any():
        row = _index(int(bad.flatten().nonzero()[0]), sums.shape)
        _fail(
            f"row {row if len(row) > 1 else row[0]} of {name} sums to {sums[row].item():.4g}, expected {expected[row].item():g}"
            " (is the softmax taken over the last axis, the keys?)"
        )


def assert_masked_are_zero(weights, mask, name: str = "your weights") -> None:
    """Every position where mask is False gets exactly zero weight."""
    leaked = weights.masked_fill(mask, 0.0).abs()
    if (leaked > 0).any():
        where = _index(int(leaked.flatten().argmax()), weights.shape)
        _fail(
            f"{name} gives weight {weights[where].item():.4g} to a masked position {where}; masked positions "
            "(mask == False) must get exactly 0. Is the mask ignored or inverted?"
        )


def _passed(what: str) -> None:
    print(f"✓ {what}: all visible checks passed.")


# --- chapter 01 -------------------------------------------------------------------------

def _softmax64(scores, mask=None):
    """Float64 oracle for masked softmax: exp / sum over the kept keys only."""
    scores = scores.double()
    if mask is None:
        mask = torch.ones_like(scores, dtype=torch.bool)
    mask = mask.expand(scores.shape)
    shifted = scores - scores.masked_fill(~mask, -math.inf).amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    exp = shifted.exp() * mask
    total = exp.sum(-1, keepdim=True)
    return torch.where(total > 0, exp / total.clamp_min(1e-300), torch.zeros_like(exp))


def check_masked_softmax(masked_softmax) -> None:
    """Visible checks for chapter 01, exercise 1."""
    gen = torch.Generator().manual_seed(101)
    scores = torch.randn(3, 5, generator=gen)
    out = masked_softmax(scores)
    assert_shape(out, (3, 5), "masked_softmax(scores) with scores of shape (3, 5)")
    assert_rows_sum_to_one(out, "your weights (no mask)")
    assert_close(out, torch.softmax(scores, dim=-1), "masked_softmax(scores) with no mask")

    mask = torch.tensor([[True, True, True, False, False]] * 3)
    out = masked_softmax(scores, mask)
    assert_masked_are_zero(out, mask)
    assert_rows_sum_to_one(out, "your weights (with a padding mask)", mask)
    assert_close(out, _softmax64(scores, mask), "masked_softmax(scores, mask)")
    _passed("masked_softmax")


def additive_attention_oracle(query, keys, values, W_q, W_k, v, mask=None):
    """Float64 oracle written as the paper's double loop over (query i, key j)."""
    q64, k64, v64 = query.double(), keys.double(), values.double()
    energies = torch.empty(*query.shape[:-1], keys.shape[-2], dtype=torch.float64)
    for i in range(query.shape[-2]):
        for j in range(keys.shape[-2]):
            hidden = torch.tanh(q64[..., i, :] @ W_q.double() + k64[..., j, :] @ W_k.double())
            energies[..., i, j] = hidden @ v.double()
    weights = _softmax64(energies, None if mask is None else mask.expand(energies.shape))
    return weights @ v64, weights


def check_additive_attention(additive_attention) -> None:
    """Visible checks for chapter 01, exercise 2 (no mask; the hidden tests add masks and batches)."""
    gen = torch.Generator().manual_seed(102)
    query, keys, values = torch.randn(2, 3, generator=gen), torch.randn(4, 5, generator=gen), torch.randn(4, 6, generator=gen)
    W_q, W_k, v = torch.randn(3, 7, generator=gen), torch.randn(5, 7, generator=gen), torch.randn(7, generator=gen)
    result = additive_attention(query, keys, values, W_q, W_k, v)
    if not isinstance(result, tuple) or len(result) != 2:
        _fail(f"additive_attention should return a tuple (context, weights), got {type(result).__name__}")
    context, weights = result
    assert_shape(weights, (2, 4), "weights for 2 queries and 4 keys")
    assert_shape(context, (2, 6), "context for 2 queries and values of size 6")
    assert_rows_sum_to_one(weights)
    expected_context, expected_weights = additive_attention_oracle(query, keys, values, W_q, W_k, v)
    assert_close(weights, expected_weights, "your attention weights")
    assert_close(context, expected_context, "your context vectors")
    _passed("additive_attention")


def check_scaled_dot_product_attention(scaled_dot_product_attention) -> None:
    """Visible checks for chapter 01, exercise 3, against torch.nn.functional.scaled_dot_product_attention."""
    gen = torch.Generator().manual_seed(103)
    q, k, v = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(6, 3, generator=gen)
    result = scaled_dot_product_attention(q, k, v)
    if not isinstance(result, tuple) or len(result) != 2:
        _fail(f"scaled_dot_product_attention should return a tuple (out, weights), got {type(result).__name__}")
    out, weights = result
    assert_shape(weights, (4, 6), "weights for 4 queries and 6 keys")
    assert_shape(out, (4, 3), "out for 4 queries and values of size 3")
    assert_rows_sum_to_one(weights)
    expected_weights = torch.softmax(q.double() @ k.double().T / math.sqrt(8), dim=-1)
    ratio = (weights.double().log() - weights.double().log().mean(-1, keepdim=True)).std() / (
        expected_weights.log() - expected_weights.log().mean(-1, keepdim=True)
    ).std()
    if abs(ratio - 1) > 1e-3:
        _fail(
            f"your weights are as peaked as scores scaled by {1 / math.sqrt(8) * ratio.item():.4g}; the expected scale is "
            f"1/sqrt(d_k) = 1/sqrt(8) = {1 / math.sqrt(8):.4g} (d_k is the size of a query/key vector, q.shape[-1])"
        )
    assert_close(weights, expected_weights, "your attention weights")
    assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), "your output")
    _passed("scaled_dot_product_attention")

"""Attention, chapter 01: masked softmax, additive (Bahdanau) and scaled dot-product attention.

Conventions used throughout the course:

* A *mask* is a boolean tensor that broadcasts against the scores; ``True`` means
  "this query may attend to this key" (the convention of
  ``torch.nn.functional.scaled_dot_product_attention``).
* Shapes are written ``(..., Tq, Tk)``: any number of leading batch/head dimensions,
  then queries, then keys.

The functions below are the reference solutions of chapter 01's exercises; the
notebook's solution cells are the same code (``tests/test_solution_drift.py`` checks).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def masked_softmax(scores, mask=None):
    """Softmax over the last axis that gives masked positions exactly zero weight.

    scores: (..., Tq, Tk) float; mask: bool, broadcastable to scores, True = keep.
    Returns weights of the same shape as scores. A row whose keys are all masked
    gets all-zero weights (not NaN), and its gradient stays finite.
    """
    if mask is None:
        return torch.softmax(scores, dim=-1)
    # Fill with the most negative finite number, not -inf: a row that is entirely -inf
    # has softmax 0/0 = NaN, and NaN would also poison the gradient of the whole batch.
    filled = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(filled, dim=-1)
    # A fully masked row came out uniform over its (masked) keys: zero it.
    return weights.masked_fill(~mask, 0.0)


def additive_attention(query, keys, values, W_q, W_k, v, mask=None):
    """Additive (Bahdanau) attention: score(q, k) = v . tanh(W_q q + W_k k).

    query: (..., Tq, Dq)   keys: (..., Tk, Dk)   values: (..., Tk, Dv)
    W_q: (Dq, A)   W_k: (Dk, A)   v: (A,)   mask: bool, broadcastable to (..., Tq, Tk)
    Returns (context (..., Tq, Dv), weights (..., Tq, Tk)).
    """
    projected_q = (query @ W_q).unsqueeze(-2)  # (..., Tq, 1, A)
    projected_k = (keys @ W_k).unsqueeze(-3)  # (..., 1, Tk, A)
    energies = torch.tanh(projected_q + projected_k) @ v  # (..., Tq, Tk)
    weights = masked_softmax(energies, mask)
    return weights @ values, weights


def scaled_dot_product_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d_k)) v, with an optional boolean mask.

    q: (..., Tq, Dk)   k: (..., Tk, Dk)   v: (..., Tk, Dv)
    mask: bool, broadcastable to (..., Tq, Tk), True = attend.
    Returns (out (..., Tq, Dv), weights (..., Tq, Tk)).
    """
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., Tq, Tk)
    weights = masked_softmax(scores, mask)
    return weights @ v, weights


class AdditiveAttention(nn.Module):
    """Additive attention with learned W_q (Dq, A), W_k (Dk, A) and v (A,)."""

    def __init__(self, query_dim: int, key_dim: int, attention_dim: int):
        super().__init__()
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim), ("attention_dim", attention_dim)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.W_q = nn.Parameter(torch.randn(query_dim, attention_dim) / math.sqrt(query_dim))
        self.W_k = nn.Parameter(torch.randn(key_dim, attention_dim) / math.sqrt(key_dim))
        self.v = nn.Parameter(torch.randn(attention_dim) / math.sqrt(attention_dim))

    def forward(self, query, keys, values, mask=None):
        """query (..., Tq, Dq), keys (..., Tk, Dk), values (..., Tk, Dv) -> (context, weights)."""
        return additive_attention(query, keys, values, self.W_q, self.W_k, self.v, mask)

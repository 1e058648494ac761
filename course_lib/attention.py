"""Attention, chapter 01: masked softmax, additive (Bahdanau) and scaled dot-product attention.

Conventions used throughout the course:

* A *mask* is a boolean tensor that broadcasts against the scores; ``True`` means
  "this query may attend to this key" (the convention of
  ``torch.nn.functional.scaled_dot_product_attention``).
* Shapes are written ``(..., Tq, Tk)``: any number of leading batch/head dimensions,
  then queries, then keys.

The functions below are the reference solutions of chapter 01's exercises; the
notebook's solution cells are the same code (``tests/grading/test_solution_drift.py`` checks).
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
    """Additive (Bahdanau) attention of each query over the keys, with the learned W_q, W_k and v.

    query: (..., Tq, Dq)   keys: (..., Tk, Dk)   values: (..., Tk, Dv)
    W_q: (Dq, A)   W_k: (Dk, A)   v: (A,)   mask: bool, broadcastable to (..., Tq, Tk), True = keep.
    Returns (context (..., Tq, Dv), weights (..., Tq, Tk)); masked keys get exactly zero weight.
    """
    projected_q = (query @ W_q).unsqueeze(-2)  # (..., Tq, 1, A)
    projected_k = (keys @ W_k).unsqueeze(-3)  # (..., 1, Tk, A)
    energies = torch.tanh(projected_q + projected_k) @ v  # (..., Tq, Tk)
    weights = masked_softmax(energies, mask)
    return weights @ values, weights


def scaled_dot_product_attention(q, k, v, mask=None):
    """Scaled dot-product attention (Vaswani et al., 2017) of each query over the keys, with an optional boolean mask.

    q: (..., Tq, Dk)   k: (..., Tk, Dk)   v: (..., Tk, Dv)
    mask: bool, broadcastable to (..., Tq, Tk), True = attend.
    Returns (out (..., Tq, Dv), weights (..., Tq, Tk)). A query whose keys are all masked gets
    all-zero weights and an all-zero output (not NaN).
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


# --- chapter 02: multi-head attention -------------------------------------------------


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Split the feature axis into heads: (B, T, D) -> (B, H, T, D / H).

    Head h gets the columns h*Dh ... (h+1)*Dh - 1 of every position (Dh = D / H).
    The result is a view of x (no copy); it is not contiguous when H > 1 and T > 1.
    """
    if x.dim() != 3:
        raise ValueError(f"x must have shape (B, T, D), got {tuple(x.shape)}")
    if n_heads < 1 or x.shape[-1] % n_heads != 0:
        raise ValueError(f"the last dimension of x ({x.shape[-1]}) must be divisible by n_heads, got n_heads={n_heads}")
    batch, time, d_model = x.shape
    # splitting one axis in two never needs a copy, so view works even for a non-contiguous x
    return x.view(batch, time, n_heads, d_model // n_heads).transpose(1, 2)  # (B, H, T, Dh)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the heads again: (B, H, T, Dh) -> (B, T, H * Dh), contiguous.

    The inverse of split_heads: position t's features are head 0's Dh values, then head 1's, ...
    x may be laid out in any way: a fresh, contiguous tensor (as weights @ v returns it) or a view
    (as split_heads returns it). Batch elements never mix.
    """
    if x.dim() != 4:
        raise ValueError(f"x must have shape (B, H, T, Dh), got {tuple(x.shape)}")
    batch, n_heads, time, d_head = x.shape
    # transpose back to (B, T, H, Dh) first; .contiguous() copies into that order so view can merge H and Dh
    return x.transpose(1, 2).contiguous().view(batch, time, n_heads * d_head)


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al., 2017): n_heads attentions side by side, one per chunk of d_model / n_heads features.

    Contract (the hidden tests copy these weights into torch.nn.MultiheadAttention and compare):
    attributes W_q, W_k, W_v, W_o, each nn.Linear(d_model, d_model, bias=bias), and n_heads. Head h owns
    features h*Dh ... (h+1)*Dh - 1 (Dh = d_model / n_heads) of W_q(query), W_k(key) and W_v(value).
    Raises ValueError naming d_model and n_heads when d_model is not a positive multiple of n_heads, and one
    naming dropout when it is not in [0, 1). Dropout acts on the attention weights in training mode only; the tests run in eval mode.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if d_model < 1 or n_heads < 1:
            raise ValueError(f"d_model and n_heads must be >= 1, got d_model={d_model} and n_heads={n_heads}")
        if d_model % n_heads != 0:
            raise ValueError(f"d_model must be a multiple of n_heads, got d_model={d_model} and n_heads={n_heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model, self.n_heads, self.d_head = d_model, n_heads, d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=bias)
        self.W_k = nn.Linear(d_model, d_model, bias=bias)
        self.W_v = nn.Linear(d_model, d_model, bias=bias)
        self.W_o = nn.Linear(d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        """query (B, Tq, D), key and value (B, Tk, D); mask bool, broadcastable to (B, H, Tq, Tk), True = attend.

        Returns (out (B, Tq, D), weights (B, H, Tq, Tk)): weights[b, h, i, j] is head h's weight of query i on
        key j, before dropout; each row sums to 1 over the keys it may attend to. Tq and Tk may differ. A query
        whose keys are all masked gets all-zero weights (no NaN), so its output is W_o's bias.
        Raises ValueError when mask is not a bool tensor. Permuting the positions of query permutes the output
        rows the same way; permuting key and value together (and the mask's columns) changes nothing.
        """
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = attend), got dtype {mask.dtype}")
        q = split_heads(self.W_q(query), self.n_heads)  # (B, H, Tq, Dh)
        k = split_heads(self.W_k(key), self.n_heads)  # (B, H, Tk, Dh)
        v = split_heads(self.W_v(value), self.n_heads)  # (B, H, Tk, Dh)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, Tq, Tk): scaled by the head size
        weights = masked_softmax(scores, mask)
        heads = self.dropout(weights) @ v  # (B, H, Tq, Dh)
        return self.W_o(merge_heads(heads)), weights

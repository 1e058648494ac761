"""Positional information, chapter 02: sinusoidal and learned encodings, RoPE and ALiBi.

Self-attention is permutation-equivariant: it sees a set, not a sequence. Each function
below tells it where a token is, in one of the four ways in use today:

* ``sinusoidal_encoding`` — a fixed table added to the token embeddings (Vaswani et al., 2017);
* ``LearnedPositionalEmbedding`` — a trained table added to the token embeddings (BERT, GPT-2);
* ``apply_rope`` — rotates query and key vectors by position-dependent angles (Su et al., RoFormer);
* ``alibi_bias`` — a per-head linear penalty on the attention scores (Press et al., 2022).

RoPE comes in two layouts that pair the features of a head differently: ``apply_rope`` pairs (2i, 2i+1)
(interleaved, RoFormer and Meta's Llama code), ``apply_rope_half`` pairs (i, i + Dh/2) (Hugging Face's
``rotate_half``). ``rope_to_half`` / ``rope_to_interleaved`` permute the rows of a query or key projection
so that a model of one layout computes exactly what the other computes (chapter 11).

``sinusoidal_encoding`` and ``apply_rope`` are reference solutions of chapter 02's exercises, ``rope_to_half``
of chapter 11's; the notebooks' solution cells are the same code (``tests/grading/test_solution_drift.py`` checks).
"""
from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_encoding(max_len: int, d_model: int) -> torch.Tensor:
    """The Transformer's fixed sinusoidal table (chapter 02, section 5), (max_len, d_model), float32.

    Interleaved layout (Vaswani et al., 2017): column pair (2i, 2i+1) holds frequency i, its sine in the
    even column and its cosine in the odd one. The first pair oscillates fastest (period 2*pi positions),
    the last slowest. Raises ValueError naming max_len if it is below 1, and naming d_model unless it is a
    positive even number.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if d_model < 2 or d_model % 2 != 0:
        raise ValueError(f"d_model must be a positive even number (sin/cos columns come in pairs), got {d_model}")
    position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, 1)
    frequency = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d_model/2,): 10000^(-2i/d)
    angle = position * frequency  # (max_len, d_model/2), in float64: float32 loses ~1e-5 at positions in the hundreds
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle)
    return table.float()


class LearnedPositionalEmbedding(nn.Module):
    """A trained position table (BERT, GPT-2's ``wpe``): x + P[0:T] for inputs x of shape (B, T, D).

    The table has max_len rows and cannot represent a position >= max_len: longer inputs raise.
    Initialised N(0, 0.02^2), as GPT-2's initializer_range.
    """

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        if max_len < 1 or d_model < 1:
            raise ValueError(f"max_len and d_model must be >= 1, got max_len={max_len} and d_model={d_model}")
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, D) -> x + P[0:T] (B, T, D); T must be <= max_len."""
        time = x.shape[-2]
        if time > self.max_len:
            raise ValueError(f"sequence length {time} exceeds max_len={self.max_len} of this learned position table")
        return x + self.embedding(torch.arange(time, device=x.device))


def apply_rope(x: torch.Tensor, positions: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding (Su et al., RoFormer): rotate each pair of features by a position-dependent angle.

    x: (..., T, Dh) with Dh even; positions: (T,) or broadcastable to x.shape[:-1] (for example (B, 1, T)),
    default 0, 1, ..., T-1. Returns a tensor like x.

    Pairing convention: the *interleaved* pairs (2i, 2i+1), as in the RoFormer paper and Meta's original
    LLaMA code; pair i turns counter-clockwise (from feature 2i towards 2i+1) by its angle of chapter 02,
    section 7, with this base. (Hugging Face's ``rotate_half`` pairs i with i + Dh/2 instead: the same
    rotation after a fixed permutation of the features, but the two are not interchangeable for
    given weights.)
    """
    d_head, time = x.shape[-1], x.shape[-2]
    if d_head % 2 != 0:
        raise ValueError(f"the last dimension of x must be even (RoPE rotates pairs of features), got {d_head}")
    if positions is None:
        positions = torch.arange(time, device=x.device)
    if positions.shape[-1] != time:
        raise ValueError(f"positions must have T={time} entries in its last dimension, got shape {tuple(positions.shape)}")
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64, device=x.device) / d_head)  # (Dh/2,)
    angle = positions.to(torch.float64)[..., None] * theta  # (..., T, Dh/2), float64 for long contexts
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]  # (..., T, Dh/2): the two coordinates of each pair
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)  # (..., T, Dh/2, 2)
    return rotated.flatten(-2)  # (..., T, Dh): pairs back in interleaved order


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al., 2022), (H,) float32.

    For H a power of two: m_h = 2^(-8 (h+1) / H), h = 0 ... H-1 (a geometric sequence from 2^(-8/H) to 2^-8).
    Otherwise the rule of the ALiBi authors' code, not of the paper (which trains only powers of two):
    ``get_slopes`` in github.com/ofirpress/attention_with_linear_biases takes the slopes of the largest
    power of two n < H, followed by every other slope of 2n (the odd-numbered ones, 2^(-8 (2k+1) / (2n))),
    until there are H. Hugging Face's BLOOM code does the same (tests/lib/test_positional.py compares them).
    """
    if n_heads < 1:
        raise ValueError(f"n_heads must be >= 1, got {n_heads}")
    closest = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / closest) for h in range(closest)]
    slopes += [2.0 ** (-8.0 * (h + 1) / (2 * closest)) for h in range(0, 2 * closest, 2)][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(n_heads: int, T_q: int, T_k: int | None = None) -> torch.Tensor:
    """ALiBi bias to add to the attention scores: (H, Tq, Tk), bias[h, i, j] = -m_h * |i + Tk - Tq - j|.

    Query i sits at absolute position i + Tk - Tq (the queries are the last Tq of the Tk positions, as when
    decoding with a cache; Tk = Tq by default). For the keys a causal model may see (j <= its position)
    this is the paper's m_h * (j - i); combine it with a causal mask for a decoder.
    """
    T_k = T_q if T_k is None else T_k
    if T_q < 1 or T_k < T_q:
        raise ValueError(f"need 1 <= T_q <= T_k, got T_q={T_q} and T_k={T_k}")
    query_position = torch.arange(T_k - T_q, T_k)[:, None]  # (Tq, 1)
    distance = (query_position - torch.arange(T_k)[None, :]).abs()  # (Tq, Tk)
    return -alibi_slopes(n_heads)[:, None, None] * distance  # (H, Tq, Tk)


def rope_cos_sin(positions: torch.Tensor, d_head: int, base: float = 10000.0, dtype=torch.float32):
    """cos and sin of RoPE's angles pos * theta_i, theta_i = base^(-2i / Dh), i = 0 .. Dh/2 - 1.

    positions: any shape (...,) -> (cos, sin), each (..., Dh/2) in dtype; the angles are computed in float64.
    """
    if d_head < 2 or d_head % 2 != 0:
        raise ValueError(f"d_head must be a positive even number (RoPE rotates pairs of features), got {d_head}")
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64, device=positions.device) / d_head)  # (Dh/2,)
    angle = positions.to(torch.float64)[..., None] * theta  # (..., Dh/2)
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotate_half_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (i, i + Dh/2) of x (..., Dh) by the angles whose cos, sin (broadcastable to (..., Dh/2)) are given."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]  # (..., Dh/2): the two coordinates of each pair
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def rotate_interleaved_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (2i, 2i + 1) of x (..., Dh) by the angles whose cos, sin (broadcastable to (..., Dh/2)) are given."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def apply_rope_half(x: torch.Tensor, positions: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """RoPE in Hugging Face's layout: feature i is paired with feature i + Dh/2 (``rotate_half``).

    x: (..., T, Dh) with Dh even; positions as for ``apply_rope`` (default 0 .. T-1). Returns a tensor like x.
    Pair i turns by pos * theta_i with theta_i = base^(-2i / Dh), the same angles as ``apply_rope``'s pair
    (2i, 2i+1): apply_rope_half(x[..., p]) == apply_rope(x)[..., p] for p = ``rope_permutation(Dh)``.
    """
    time = x.shape[-2]
    if positions is None:
        positions = torch.arange(time, device=x.device)
    if positions.shape[-1] != time:
        raise ValueError(f"positions must have T={time} entries in its last dimension, got shape {tuple(positions.shape)}")
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, x.dtype)  # raises for an odd Dh
    return rotate_half_layout(x, cos, sin)


def rope_permutation(d_head: int) -> torch.Tensor:
    """The feature order that turns the interleaved layout into the half layout: (Dh,) int64, [0, 2, 4, ..., 1, 3, 5, ...].

    Half-layout feature j < Dh/2 is interleaved feature 2j, and half-layout feature Dh/2 + j is interleaved 2j + 1.
    """
    if d_head < 2 or d_head % 2 != 0:
        raise ValueError(f"d_head must be a positive even number, got {d_head}")
    return torch.cat((torch.arange(0, d_head, 2), torch.arange(1, d_head, 2)))


def rope_to_half(weight, n_heads):
    """Rows of a query or key projection for interleaved RoPE -> the same model for half-split RoPE.

    weight: (n_heads * Dh, C), the nn.Linear weight of W_q (n_heads = H) or W_k (n_heads = H_kv), head after
    head. Returns a new (n_heads * Dh, C) tensor, its rows permuted within each head (never across heads) so
    that feature pair (2i, 2i+1) of the interleaved layout becomes pair (i, i + Dh/2) of the half layout: the
    permutation of Hugging Face's convert_llama_weights_to_hf.py. Queries and keys are
    both permuted the same way, so their dot products, and the model's outputs, do not change.
    """
    rows, columns = weight.shape
    d_head = rows // n_heads
    # (H, Dh/2, 2, C): row 2j + a of a head is pair j, coordinate a; put coordinate a first: row a * Dh/2 + j
    return weight.reshape(n_heads, d_head // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def rope_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of ``rope_to_half``: rows of W_q or W_k (n_heads * Dh, C) for half-split RoPE -> interleaved."""
    rows, columns = weight.shape
    if n_heads < 1 or rows % n_heads != 0 or (rows // n_heads) % 2 != 0:
        raise ValueError(f"n_heads must divide the {rows} rows into heads of even size, got n_heads={n_heads}")
    d_head = rows // n_heads
    return weight.reshape(n_heads, 2, d_head // 2, columns).transpose(1, 2).reshape(rows, columns)

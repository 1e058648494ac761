"""Chapter 14: attention in tiles (FlashAttention's forward pass, on a CPU, in PyTorch).

The three exercises' reference solutions (``online_softmax``, ``merge_partials``, ``tiled_attention``: the
notebook's answer cells hold the same code, tests/grading/test_solution_drift.py keeps them equal), and what the chapter
builds on them: split-K decoding ("flash-decoding"), chapter 12's paged attention as an online softmax over
blocks, the causal tile count, the IO model of Dao et al. (2022, Theorem 2) counted exactly, and a measure of
the largest tensor a function creates.

Conventions: ``q (B, H, Tq, D)``, ``k (B, H, Tk, D)``, ``v (B, H, Tk, Dv)`` (any number of leading axes); a mask
is boolean, broadcastable to ``(B, H, Tq, Tk)``, ``True`` = may attend (as ``F.scaled_dot_product_attention``);
``causal`` lets query i see keys 0 .. i (top-left aligned, as SDPA's ``is_causal``). ``lse`` is the log of the
softmax's normaliser, ``log sum_j exp(s_j)`` over the keys a query sees (``-inf`` when it sees none).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["online_softmax", "merge_partials", "tiled_attention", "split_k_attention", "paged_attention_online",
           "causal_tile_counts", "hbm_accesses", "fa_block_sizes", "largest_tensor_created", "aten_ops"]


def online_softmax(blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax's statistics of rows that arrive in pieces: (m, l), each (...).

    blocks: an iterable of tensors (..., n_i), n_i >= 1, the consecutive pieces of each row (their
    concatenation along the last axis is the row x), each read once (a generator will do). Returns m, the
    max of each row, and l = sum_j exp(x_j - m), so that softmax(x) = exp(x - m) / l. Entries may be
    -inf (masked); a row that is -inf everywhere gives m = -inf and l = 0, never NaN. Values as large as
    1e4 must not overflow. ValueError if there are no blocks, or if a block's rows (its leading axes) are not
    the first block's.
    """
    ### BEGIN SOLUTION
    m = l = None
    for x in blocks:
        if m is None:
            m = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype, device=x.device)
            l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        if x.shape[:-1] != m.shape:
            raise ValueError(f"blocks must all hold the first block's rows {tuple(m.shape)}, got a block of shape {tuple(x.shape)}")
        if x.dim() == 0 or x.shape[-1] == 0:
            raise ValueError(f"blocks must each hold at least one entry of every row (..., n_i >= 1), got a block of shape {tuple(x.shape)}")
        m_new = torch.maximum(m, x.amax(-1))  # the max so far, this block included
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # a row with nothing but -inf so far: keep 0, not NaN
        l = l * torch.exp(m - m_safe) + torch.exp(x - m_safe[..., None]).sum(-1)  # old sum rescaled to the new max
        m = m_new
    if m is None:
        raise ValueError("online_softmax needs at least one block")
    return m, l
    ### END SOLUTION


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a union of key sets from the results over each set: (out (..., Dv), lse (...)).

    outs (P, ..., Dv): P partial results, outs[p] the attention output over key set p alone (its softmax
    normalised over that set only); lses (P, ...): lses[p] = log sum_{j in set p} exp(s_j), the scores'
    log-normaliser over set p. The sets are disjoint. Returns the output and lse over their union, equal
    (up to float rounding) to attention over all the keys at once. A partial with lse -inf (its set held no
    key the query may see) contributes nothing, whatever its out holds (zeros or NaN); if every partial is
    -inf, out is 0 and lse is -inf. lses up to 1e4 must not overflow. ValueError if lses's shape is not outs's
    without its last axis.
    """
    ### BEGIN SOLUTION
    if lses.shape != outs.shape[:-1]:
        raise ValueError(f"lses must have the shape of outs without its last axis, {tuple(outs.shape[:-1])}, got {tuple(lses.shape)}")
    lse = torch.logsumexp(lses, dim=0)  # (...): log of the summed normalisers; -inf if every set was empty
    lse_safe = lse.masked_fill(lse == -math.inf, 0.0)
    weights = torch.exp(lses - lse_safe)  # (P, ...): each set's share of the total normaliser; 0 for an empty set
    terms = torch.where(weights[..., None] > 0, weights[..., None] * outs, torch.zeros_like(outs))  # no 0 * NaN
    return terms.sum(0), lse
    ### END SOLUTION


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    causal: bool = False, block_q: int = 64, block_k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention computed tile by tile: (out (..., Tq, Dv), lse (..., Tq)).

    q (..., Tq, D), k (..., Tk, D), v (..., Tk, Dv); mask bool, broadcastable to (..., Tq, Tk), True = may
    attend; causal: query i sees keys 0 .. i only (as F.scaled_dot_product_attention's is_causal; with a mask,
    a key must pass both). Scores scaled by 1 / sqrt(D). out equals F.scaled_dot_product_attention(q, k, v,
    attn_mask=..., is_causal=...) up to float rounding; a query that may see no key gets out 0 and lse -inf
    (no NaN). lse[..., i] = log sum_j exp(s_ij) over the keys query i sees. Same dtype as q (all three share
    it); for float16 and bfloat16 inputs the scores, running max, running sum and accumulator are float32 (as
    in FlashAttention and SDPA), only out and lse are rounded to q's dtype.

    Memory: no tensor created may grow with Tq * Tk: besides the output (and tensors the size of q, k or v),
    nothing larger than a few tiles of (..., block_q, block_k) scores (or (..., block_q, block_k, D) if you
    multiply and sum). Tiles that causality masks entirely are never computed.
    ValueError, naming the argument, if block_q or block_k is below 1, k's head size is not q's, v's rows are
    not k's, k or v has another dtype than q, or mask is not boolean or does not broadcast to (..., Tq, Tk).
    """
    ### BEGIN SOLUTION
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q and block_k must be at least 1, got {block_q} and {block_k}")
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
        raise ValueError(f"k must be (..., Tk, D) with q's D and v (..., Tk, Dv) with k's Tk: got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must have q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    *lead, Tq, D = q.shape
    Tk, Dv = k.shape[-2], v.shape[-1]
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be boolean (True = may attend), got {mask.dtype}")
        try:
            mask = mask.expand(*lead, Tq, Tk)  # a view: slicing a tile of it copies only the tile
        except RuntimeError:
            raise ValueError(f"mask must broadcast to {(*lead, Tq, Tk)}, got {tuple(mask.shape)}") from None
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype  # accumulate in float32 at least
    scale = 1.0 / math.sqrt(D)
    out = q.new_zeros(*lead, Tq, Dv)
    lse = q.new_full((*lead, Tq), -math.inf)
    for i in range(0, Tq, block_q):  # outer loop: one tile of queries at a time (FlashAttention-2's order)
        q_tile = q[..., i:i + block_q, :].to(work) * scale
        n_q = q_tile.shape[-2]
        m = q_tile.new_full((*lead, n_q), -math.inf)  # running max of each query's scores
        l = q_tile.new_zeros(*lead, n_q)  # running sum of exp(score - m)
        acc = q_tile.new_zeros(*lead, n_q, Dv)  # running sum of exp(score - m) * value
        last = min(Tk, i + n_q) if causal else Tk  # causal: keys past the tile's last query are skipped
        for j in range(0, last, block_k):
            s = q_tile @ k[..., j:j + block_k, :].to(work).transpose(-2, -1)  # (..., n_q, n_k): one tile of scores
            n_k = s.shape[-1]
            keep = None
            if causal and j + n_k - 1 > i:  # the tile crosses the diagonal
                keep = torch.arange(i, i + n_q, device=q.device)[:, None] >= torch.arange(j, j + n_k, device=q.device)
            if mask is not None:
                tile = mask[..., i:i + n_q, j:j + n_k]
                keep = tile if keep is None else keep & tile
            if keep is not None:
                s = s.masked_fill(~keep, -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)  # no key seen yet: nothing to rescale, no NaN
            alpha = torch.exp(m - m_safe)  # rescales what was summed under the old max
            p = torch.exp(s - m_safe[..., None])
            l = l * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p @ v[..., j:j + n_k, :].to(work)
            m = m_new
        seen = l > 0
        out[..., i:i + n_q, :] = (acc / torch.where(seen, l, torch.ones_like(l))[..., None]).to(q.dtype)
        lse[..., i:i + n_q] = torch.where(seen, m + torch.log(l), torch.full_like(l, -math.inf)).to(q.dtype)
    return out, lse
    ### END SOLUTION


def split_k_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, splits: int, mask: torch.Tensor | None = None,
                      tiled_attention: Callable = tiled_attention, merge_partials: Callable = merge_partials):
    """Decoding attention split along the keys ("flash-decoding"): (out (..., Tq, Dv), lse (..., Tq)).

    The Tk keys are cut into `splits` contiguous chunks; each chunk's attention, ``tiled_attention(q, k_c, v_c,
    mask_c)`` -> (out_c, lse_c), is independent of the others (on a GPU, one thread block each);
    ``merge_partials`` combines the partial results by their log-sum-exp. mask bool broadcastable to (..., Tq, Tk)."""
    if splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    Tk = k.shape[-2]
    size = math.ceil(Tk / splits)
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], Tk)
    outs, lses = [], []
    for j in range(0, Tk, size):
        out, lse = tiled_attention(q, k[..., j:j + size, :], v[..., j:j + size, :],
                                   None if mask is None else mask[..., j:j + size])
        outs.append(out)
        lses.append(lse)
    return merge_partials(torch.stack(outs), torch.stack(lses))


def paged_attention_online(q: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, tiled_attention: Callable = tiled_attention,
                           merge_partials: Callable = merge_partials) -> torch.Tensor:
    """Chapter 12's paged attention as an online softmax over blocks: (B, H, Dh), the same contract as
    ``course_lib.serving.paged_attention``. One block of the pool at a time (no contiguous copy of a sequence's
    keys): the block's partial result (``tiled_attention`` over its S slots, those past context_lens masked) is
    merged into the running one (``merge_partials``), so the memory held is one block, whatever the context."""
    B, H, Dh = q.shape
    S = key_pool.shape[1]
    out = q.new_zeros(B, H, 1, value_pool.shape[-1])
    lse = q.new_full((B, H, 1), -math.inf)
    for c in range(block_tables.shape[1]):
        if not bool((context_lens > c * S).any()):
            break  # no sequence has a token in column c of its table or later
        blocks = block_tables[:, c]
        keys = key_pool[blocks].transpose(1, 2)  # (B, H, S, Dh): this column's block of every sequence
        values = value_pool[blocks].transpose(1, 2)
        valid = (c * S + torch.arange(S, device=q.device))[None, :] < context_lens[:, None]  # (B, S)
        part, part_lse = tiled_attention(q[:, :, None], keys, values, valid[:, None, None, :])
        out, lse = merge_partials(torch.stack([out, part]), torch.stack([lse, part_lse]))
    return out[:, :, 0]


def causal_tile_counts(Tq: int, Tk: int, block_q: int, block_k: int) -> tuple[int, int]:
    """(tiles computed, tiles in the grid) of causal attention: a tile is computed iff one of its keys is visible
    to one of its queries (key j <= query i), counted tile by tile from that definition. ValueError if a size is
    below 1."""
    for name, size in (("Tq", Tq), ("Tk", Tk), ("block_q", block_q), ("block_k", block_k)):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    computed = total = 0
    for i in range(0, Tq, block_q):
        last_query = min(i + block_q, Tq) - 1
        for j in range(0, Tk, block_k):
            total += 1
            computed += j <= last_query
    return computed, total


def fa_block_sizes(d: int, M: int) -> tuple[int, int]:
    """(B_r, B_c) of FlashAttention's Algorithm 1 (Dao et al., 2022) for head size d and fast memory of M elements:
    B_c = ceil(M / 4d), B_r = min(ceil(M / 4d), d)."""
    bc = math.ceil(M / (4 * d))
    return min(bc, d), bc


def hbm_accesses(N: int, d: int, M: int | None = None, algorithm: str = "standard") -> int:
    """Elements read from and written to slow memory (HBM) by one attention head, counted exactly as the
    algorithms of Dao et al. (2022) are written.

    "standard" (their Algorithm 0): read Q, K, write S; read S, write P; read P, V, write O: 4 N^2 + 4 N d.
    "flash" (Algorithm 1, outer loop over key/value tiles): O, l, m initialised in HBM; each K_j, V_j read
    once; for every (j, i), Q_i, O_i, l_i, m_i read and O_i, l_i, m_i written.
    "flash2" (FlashAttention-2's order, this chapter's loop, same tile sizes): each Q_i read once, every K_j,
    V_j read once per query tile, O_i and its lse written once.
    ValueError if N or d is below 1, or (tiled) M is below d.
    """
    if N < 1 or d < 1:
        raise ValueError(f"N and d must be at least 1, got N={N}, d={d}")
    if algorithm == "standard":
        return 4 * N * N + 4 * N * d
    if M is None or not d <= M:
        raise ValueError(f"the tiled algorithms need a fast memory M >= d, got M={M}, d={d}")
    br, bc = fa_block_sizes(d, M)
    t_r, t_c = math.ceil(N / br), math.ceil(N / bc)
    if algorithm == "flash":
        init = N * d + 2 * N  # O = 0, l = 0, m = -inf written to HBM
        kv = 2 * N * d
        inner = t_c * (N * (2 * d + 2) + N * (d + 2))  # every (j, i): read Q_i, O_i, l_i, m_i; write O_i, l_i, m_i
        return init + kv + inner
    if algorithm == "flash2":
        return N * d + t_r * 2 * N * d + N * d + N
    raise ValueError(f"algorithm must be 'standard', 'flash' or 'flash2', got {algorithm!r}")


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.ops.append(str(func.overloadpacket.__name__))
        inputs = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in inputs:  # a view shares its input's memory
                self.largest = max(self.largest, t.numel())
        return result


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def largest_tensor_created(function: Callable, *args, **kwargs) -> tuple[int, object]:
    """(elements of the largest tensor any PyTorch operation created while ``function(*args, **kwargs)`` ran, its
    result). Views (slices, transposes, expands) create no memory and are not counted; the inputs are not either."""
    with _Largest() as mode:
        result = function(*args, **kwargs)
    return mode.largest, result


def aten_ops(function: Callable, *args, **kwargs) -> list[str]:
    """The names of the ATen operations ``function(*args, **kwargs)`` ran, in order (after PyTorch's dispatch)."""
    with _Largest() as mode:
        function(*args, **kwargs)
    return mode.ops

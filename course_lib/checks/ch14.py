"""Visible checks of chapter 14 (attention in tiles), and the oracles they compare against.

Oracles: softmax statistics and attention computed over whole rows in float64 (``torch.max``, ``torch.logsumexp``,
``F.scaled_dot_product_attention``), never course_lib.tiled's reference solutions. A query that may see no key is
defined to give output 0 and lse -inf (SDPA's CPU kernel gives 0 too; its math backend gives NaN).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from ..tiled import largest_tensor_created
from .core import assert_close, assert_shape, assert_tensor, call_learner, fail, passed, unpack_pair

__all__ = ["check_online_softmax", "check_merge_partials", "check_tiled_attention", "attention_oracle",
           "partials_oracle", "tiled_memory_bound", "largest_tensor_created"]

INF = math.inf


def _blocks(x: torch.Tensor, widths):
    """The pieces of x along its last axis, as a generator (read once)."""
    start = 0
    for w in widths:
        yield x[..., start:start + w]
        start += w


def _stats(online_softmax, x, widths, what):
    result = call_learner(lambda: online_softmax(_blocks(x, widths)), f"online_softmax on {what}",
                          "blocks is an iterable read once, in order: loop over it with `for`", (RuntimeError, TypeError))
    m, l = unpack_pair(result, "online_softmax", ("m", "l"))
    assert_tensor(m, "m")
    assert_tensor(l, "l")
    assert_shape(m, x.shape[:-1], f"m for rows of shape {tuple(x.shape)}")
    assert_shape(l, x.shape[:-1], f"l for rows of shape {tuple(x.shape)}")
    return m, l


def check_online_softmax(online_softmax) -> None:
    """Visible checks for chapter 14, exercise 1: the running max and sum of rows that arrive in blocks."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 12, generator=g, dtype=torch.float64)
    x[:, 8:] += 4.0  # the max grows in the last block: the sum so far must be rescaled
    x[2, :4] += 9.0  # row 2: the max comes first
    m, l = _stats(online_softmax, x, [4, 4, 4], "3 rows of 12 in blocks of 4")
    m_true = x.max(-1).values
    l_true = torch.exp(x - m_true[:, None]).sum(-1)
    if not torch.isfinite(l).all():
        fail(f"l = {l.tolist()}: not finite for ordinary numbers. Is the max updated after the sum? The first block "
             "then sums exp(x - (-inf)) = inf: update m first, then sum exp(x - m) with the new m. (Or is the "
             "rescaling factor upside down? exp(m_old - m_new) is at most 1; exp(m_new - m_old) is inf for the first "
             "block, whose m_old is -inf)")
    assert_close(m, m_true, "m (the max of each row)", rtol=1e-12, atol=1e-12)
    running = torch.zeros(3, dtype=torch.float64)
    for b in range(3):  # the sum without rescaling: each block against the max after it
        running += torch.exp(x[:, 4 * b:4 * b + 4] - x[:, :4 * b + 4].max(-1).values[:, None]).sum(-1)
    if torch.allclose(l, running, rtol=1e-9) and not torch.allclose(l, l_true, rtol=1e-9):
        fail(f"l = {l.tolist()}, expected {l_true.tolist()}: the running sum is not rescaled. When the max grows from "
             "m_old to m_new, everything summed so far was exp(x - m_old): multiply it by exp(m_old - m_new)")
    before = torch.zeros(3, dtype=torch.float64)
    for b in range(3):  # each block summed against the max from before it (0 for the first block)
        m_before = x[:, :4 * b].max(-1).values if b else torch.zeros(3, dtype=torch.float64)
        before += torch.exp(x[:, 4 * b:4 * b + 4] - m_before[:, None]).sum(-1)
    if torch.allclose(l, before, rtol=1e-9) and not torch.allclose(l, l_true, rtol=1e-9):
        fail(f"l = {l.tolist()}, expected {l_true.tolist()}: each block was summed against the max from before it. Is "
             "the max updated after the sum? Update m first (with this block's max), then sum exp(x - m)")
    assert_close(l, l_true, "l = sum exp(x - m) (in float64)", rtol=1e-12, atol=1e-12)
    big = torch.tensor([[100.0, 300.0, 200.0, 1000.0, 999.0]])
    m, l = _stats(online_softmax, big, [2, 2, 1], "a row of values up to 1000")
    if not torch.isfinite(l).all():
        fail(f"a row of values up to 1000 gave l = {l.item()}: exp(1000) overflows; sum exp(x - m), never exp(x)")
    assert_close(l, torch.tensor([1 + math.exp(-1)]), "l for the row [100, 300, 200, 1000, 999]", rtol=1e-6, atol=1e-6)
    masked = torch.tensor([[-INF, -INF, -INF, -INF], [-INF, 1.0, -INF, 2.0]])
    m, l = _stats(online_softmax, masked, [2, 2], "a row that is -inf everywhere and a row with -inf entries")
    if torch.isnan(m).any() or torch.isnan(l).any():
        fail(f"m = {m.tolist()}, l = {l.tolist()}: NaN for a row that is -inf everywhere (a fully masked row). "
             "exp(-inf - (-inf)) is NaN: where the max is still -inf, subtract 0 instead")
    if m[0].item() != -INF or l[0].item() != 0.0:
        fail(f"a row that is -inf everywhere should give m = -inf and l = 0, got m = {m[0].item()}, l = {l[0].item()}")
    assert_close(l[1:], torch.tensor([1 + math.exp(-1)]), "l for the row [-inf, 1, -inf, 2]")
    passed("online_softmax")


def partials_oracle(q, k, v, sizes, shift: float = 0.0):
    """Partial results over consecutive key sets of the given sizes, in float64: (outs (P, ..., Tq, Dv), lses (P, ..., Tq)).

    Each set's softmax is taken over that set alone; an empty set gives out NaN and lse -inf. `shift` is added
    to every score (lse grows by it, outputs do not change)."""
    outs, lses, start = [], [], 0
    for n in sizes:
        s = (q.double() @ k[..., start:start + n, :].double().transpose(-2, -1)) / math.sqrt(q.shape[-1]) + shift
        if n == 0:
            outs.append(torch.full((*q.shape[:-1], v.shape[-1]), float("nan"), dtype=torch.float64))
            lses.append(torch.full(q.shape[:-1], -INF, dtype=torch.float64))
        else:
            outs.append(torch.softmax(s, -1) @ v[..., start:start + n, :].double())
            lses.append(torch.logsumexp(s, -1))
        start += n
    return torch.stack(outs), torch.stack(lses)


def _merge(merge_partials, outs, lses, what):
    result = call_learner(lambda: merge_partials(outs, lses), f"merge_partials on {what}")
    out, lse = unpack_pair(result, "merge_partials", ("out", "lse"))
    assert_shape(out, outs.shape[1:], f"out for outs of shape {tuple(outs.shape)}")
    assert_shape(lse, lses.shape[1:], f"lse for lses of shape {tuple(lses.shape)}")
    return out, lse


def check_merge_partials(merge_partials) -> None:
    """Visible checks for chapter 14, exercise 2: the log-sum-exp merge of partial attention results."""
    g = torch.Generator().manual_seed(141)
    q, k, v = (torch.randn(2, 3, 8, generator=g, dtype=torch.float64), torch.randn(2, 10, 8, generator=g, dtype=torch.float64),
               torch.randn(2, 10, 5, generator=g, dtype=torch.float64))
    k[:, 7:] *= 3.0  # the last set's scores differ in size from the others'
    outs, lses = partials_oracle(q, k, v, [2, 5, 3])
    expected = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), -1) @ v
    out, lse = _merge(merge_partials, outs, lses, "three partials over 2, 5 and 3 keys")
    if torch.allclose(out, outs.mean(0), atol=1e-9) and not torch.allclose(out, expected, atol=1e-9):
        fail("out is the plain average of the partial outputs: a set holds a share exp(lse_p) / sum_q exp(lse_q) of "
             "the whole softmax, not 1 / P")
    weighted = (torch.exp(lses)[..., None] * outs).sum(0)
    if torch.allclose(out, weighted, atol=1e-9) and not torch.allclose(out, expected, atol=1e-9):
        fail("out = sum_p exp(lse_p) * out_p is not normalised: divide by sum_p exp(lse_p), the whole normaliser")
    assert_close(out, expected, "out (against attention over all 10 keys in float64)", rtol=1e-10, atol=1e-10)
    if torch.allclose(lse, lses.max(0).values) and not torch.allclose(lse, torch.logsumexp(lses, 0)):
        fail("lse is the largest partial lse: the normalisers add, so lse = log sum_p exp(lse_p)")
    if torch.allclose(lse, lses.sum(0)) and not torch.allclose(lse, torch.logsumexp(lses, 0)):
        fail("lse is the sum of the partial lse's: the normalisers add, not their logs; lse = log sum_p exp(lse_p)")
    assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) / math.sqrt(8), -1), "lse (against logsumexp of all the scores)",
                 rtol=1e-10, atol=1e-10)
    outs, lses = partials_oracle(q, k, v, [2, 5, 3], shift=1000.0)
    out, lse = _merge(merge_partials, outs, lses, "partials whose lse is about 1000")
    if not torch.isfinite(out).all():
        fail("partials with lse about 1000 gave a non-finite out: exp(1000) overflows; subtract the largest lse (or "
             "use torch.logsumexp) before exponentiating")
    assert_close(out, expected, "out for partials whose lse is about 1000", rtol=1e-9, atol=1e-9)
    outs, lses = partials_oracle(q, k, v, [4, 0, 6])
    out, lse = _merge(merge_partials, outs, lses, "a partial over an empty key set (out NaN, lse -inf)")
    if torch.isnan(out).any():
        fail("a partial whose lse is -inf (it saw no key; its out is NaN here) made the result NaN: it must contribute "
             "nothing (0 * NaN is NaN: select, do not multiply)")
    assert_close(out, expected, "out when one partial saw no key", rtol=1e-10, atol=1e-10)
    none_seen = partials_oracle(q, k, v, [0, 0])
    out, lse = _merge(merge_partials, torch.zeros_like(none_seen[0]), none_seen[1], "two partials that saw no key")
    if torch.isnan(out).any() or torch.isnan(lse).any() or (out != 0).any() or (lse != -INF).any():
        fail(f"when no partial saw a key, out should be 0 and lse -inf (no NaN), got out[0, 0] = {out[0, 0].tolist()}, "
             f"lse[0] = {lse[0].tolist()}")
    passed("merge_partials")


def attention_oracle(q, k, v, mask=None, causal=False):
    """(out, lse) of attention in float64 from whole rows: SDPA for the output, logsumexp of the masked scores for
    lse; a query that may see no key gets out 0 and lse -inf. mask bool broadcastable to (..., Tq, Tk); causal is
    top-left (key j <= query i)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    keep = torch.ones(Tq, Tk, dtype=torch.bool)
    if causal:
        keep = keep.tril()
    if mask is not None:
        keep = keep & mask
    keep = keep.expand(*q.shape[:-2], Tq, Tk)
    scores = (q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~keep, -INF)
    lse = torch.logsumexp(scores, -1)
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=keep)
    out = torch.where(keep.any(-1, keepdim=True), out, torch.zeros_like(out))
    return out.to(q.dtype), lse.to(q.dtype)


def _attend(tiled_attention, q, k, v, mask=None, causal=False, block_q=8, block_k=8, what=""):
    hint = ("a shape that does not broadcast: is a tile of the mask sliced from the mask expanded to (..., Tq, Tk)?"
            if mask is not None else "a tile's shapes: q_tile (..., n_q, D) @ k_tile.transpose(-2, -1) (..., D, n_k) gives "
            "the scores (..., n_q, n_k); transpose the last two axes only")
    result = call_learner(lambda: tiled_attention(q, k, v, mask, causal, block_q, block_k), f"tiled_attention on {what}",
                          hint, (RuntimeError, IndexError))
    out, lse = unpack_pair(result, "tiled_attention", ("out", "lse"))
    assert_shape(out, (*q.shape[:-1], v.shape[-1]), f"out ({what})")
    assert_shape(lse, q.shape[:-1], f"lse ({what})")
    return out, lse


def tiled_memory_bound(q, k, v, block_q: int, block_k: int) -> int:
    """The most elements one tensor created by tiled attention may hold: the largest of q, k, v, the output, and
    four tiles of (..., block_q, block_k, D) (a multiply-and-sum tile)."""
    lead = math.prod(q.shape[:-2])
    Tq, D, Dv = q.shape[-2], q.shape[-1], v.shape[-1]
    return max(q.numel(), k.numel(), v.numel(), lead * Tq * Dv, 4 * lead * block_q * block_k * max(D, Dv))


def check_tiled_attention(tiled_attention) -> None:
    """Visible checks for chapter 14, exercise 3: the tiled forward pass against F.scaled_dot_product_attention."""
    g = torch.Generator().manual_seed(1414)
    q, k, v = (torch.randn(2, 2, 20, 8, generator=g, dtype=torch.float64) * 2 for _ in range(3))
    want, want_lse = attention_oracle(q, k, v)
    one, _ = _attend(tiled_attention, q, k, v, block_q=8, block_k=32, what="one tile of keys (block_k 32 >= 20 keys)")
    out, lse = _attend(tiled_attention, q, k, v, block_q=8, block_k=8, what="20 queries and keys in tiles of 8")
    if not torch.isfinite(out).all():
        fail("NaN or inf in the output though every query sees every key: is the max updated after the sum (the "
             "first tile then computes exp(s - (-inf)))? Update the running max first, then exponentiate against it")
    if torch.allclose(one, want, atol=1e-9) and not torch.allclose(out, want, atol=1e-9):
        fail("right with one tile of keys, wrong with several (tiles of 8 over 20 keys): when a new tile raises the "
             "running max, the running sum and the accumulated output must both be rescaled by exp(m_old - m_new)")
    assert_close(out, want, "out, 20 keys in tiles of 8 (against SDPA in float64)", rtol=1e-10, atol=1e-10)
    assert_close(lse, want_lse, "lse = log sum_j exp(s_ij) (against logsumexp of the scores)", rtol=1e-10, atol=1e-10)
    want, want_lse = attention_oracle(q, k, v, causal=True)
    out, lse = _attend(tiled_attention, q, k, v, causal=True, block_q=8, block_k=4, what="causal, block_q 8, block_k 4")
    for diagonal, how in ((-1, "each query misses its own key (the diagonal): query i sees keys 0 .. i, itself included"),
                          (1, "each query sees one key too many (its successor): query i sees keys 0 .. i only")):
        off, _ = attention_oracle(q, k, v, mask=torch.ones(20, 20, dtype=torch.bool).tril(diagonal))
        if torch.allclose(out, off, atol=1e-9):
            fail(f"causal mask off by one: {how}. In a tile starting at query i0 and key j0, entry (a, b) is query "
                 "i0 + a and key j0 + b")
    if not torch.allclose(out, want, atol=1e-9):
        cut = {stop: attention_oracle(q, k, v, mask=torch.ones(20, 20, dtype=torch.bool).tril() & (torch.arange(20) < stop))[0]
               for stop in (4, 8, 12, 16)}  # causal, and no key from `stop` on: a loop over key tiles that ends there
        if any(torch.allclose(out[..., i0:i0 + 8, :], cut[stop][..., i0:i0 + 8, :], atol=1e-9)
               and not torch.allclose(out[..., i0:i0 + 8, :], want[..., i0:i0 + 8, :], atol=1e-9)
               for i0 in (0, 8, 16) for stop in cut if stop < min(i0 + 8, 20)):
            fail("causal, block_q 8, block_k 4: the loop over key tiles stops too early. Query tile number n does not "
                 "need key tiles 0 .. n when the tiles differ in size: it needs every key up to its LAST query, "
                 "i0 + n_q - 1 (in positions, not tile numbers)")
        same, _ = _attend(tiled_attention, q, k, v, causal=True, block_q=4, block_k=4, what="causal, tiles of 4")
        if torch.allclose(same, want, atol=1e-9):
            fail("causal: right with block_q = block_k = 4, wrong with block_q 8, block_k 4. The tile's mask must "
                 "compare global positions, query i0 + a >= key j0 + b, not the positions inside the tile")
    assert_close(out, want, "causal out, block_q 8, block_k 4 (against SDPA is_causal in float64)", rtol=1e-10, atol=1e-10)
    assert_close(lse, want_lse, "causal lse", rtol=1e-10, atol=1e-10)
    for Tq, Tk in ((12, 20), (20, 12)):  # the diagonal starts at the top left whatever Tq and Tk (SDPA's is_causal)
        qs, ks, vs = q[..., :Tq, :], k[..., :Tk, :], v[..., :Tk, :]
        want, _ = attention_oracle(qs, ks, vs, causal=True)
        out, _ = _attend(tiled_attention, qs, ks, vs, causal=True, block_q=8, block_k=4, what=f"causal, {Tq} queries, {Tk} keys")
        right, _ = attention_oracle(qs, ks, vs, mask=torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq))
        if torch.allclose(out, right, atol=1e-9) and not torch.allclose(out, want, atol=1e-9):
            fail(f"causal with {Tq} queries and {Tk} keys: the diagonal is aligned at the bottom right (query i sees keys "
                 f"0 .. i + Tk - Tq, as the FlashAttention library does for a chunk after a cache). This contract is SDPA's "
                 "is_causal: top left, query i sees keys 0 .. i whatever Tq and Tk")
        assert_close(out, want, f"causal out with {Tq} queries and {Tk} keys (top left, as SDPA's is_causal)",
                     rtol=1e-10, atol=1e-10)
    padding = torch.arange(20) < torch.tensor([20, 13]).view(2, 1, 1, 1)  # (B, 1, 1, Tk): batch 1 has 7 padding keys
    want, _ = attention_oracle(q, k, v, mask=padding)
    out, _ = _attend(tiled_attention, q, k, v, mask=padding, what="a (B, 1, 1, Tk) padding mask")
    assert_close(out, want, "out with a (B, 1, 1, Tk) padding mask", rtol=1e-10, atol=1e-10)
    blind = torch.ones(20, 20, dtype=torch.bool)
    blind[3] = False  # query 3 may see no key at all
    out, lse = _attend(tiled_attention, q, k, v, mask=blind, what="a mask that hides every key from query 3")
    if torch.isnan(out).any() or torch.isnan(lse).any():
        fail("NaN for a query that may see no key (a fully masked row): its running max stays -inf and "
             "exp(-inf - (-inf)) is NaN. Where the max is -inf subtract 0, and give that query out 0, lse -inf")
    if (out[..., 3, :] != 0).any() or (lse[..., 3] != -INF).any():
        fail(f"a query that may see no key should get out 0 and lse -inf, got out {out[0, 0, 3].tolist()}, lse {lse[0, 0, 3].item()}")
    q32, k32, v32 = (t.float() for t in (q, k, v))
    q64, k64, v64 = q, k, v
    out, lse = _attend(tiled_attention, q32, k32, v32, causal=True, block_q=5, block_k=7, what="float32, causal")
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        fail(f"out and lse should have q's dtype (float32), got {out.dtype} and {lse.dtype}")
    assert_close(out, F.scaled_dot_product_attention(q32, k32, v32, is_causal=True), "float32 causal out (against SDPA)")
    q, k, v = (torch.randn(1, 1, 160, 4, generator=g) for _ in range(3))
    bound = tiled_memory_bound(q, k, v, 16, 16)
    padding = (torch.arange(160) < 150).view(1, 1, 1, 160)
    for mask, causal, what in ((None, True, "causal"), (padding, False, "with a (B, 1, 1, Tk) padding mask")):
        largest, _ = largest_tensor_created(tiled_attention, q, k, v, mask, causal, 16, 16)
        if largest > bound:
            fail(f"160 queries and keys in tiles of 16, {what}: your function created a tensor of {largest:,} elements "
                 f"(the whole score matrix has {160 * 160:,}; the tiles allow {bound:,}). Nothing may grow with Tq * Tk: "
                 "expand the mask as a view (no copy), and build masks and scores one tile at a time")
    flops = {}
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            tiled_attention(q, k, v, None, causal, 16, 16)
        flops[causal] = counter.get_total_flops()
    if flops[False] > 0 and flops[True] > flops[False] * 55 / 100 * (1 + 1e-9):  # 55 of the 10 x 10 tiles touch the diagonal
        fail(f"160 queries and keys in tiles of 16: causal ran {flops[True] / flops[False]:.0%} of the matrix-product FLOPs "
             "of the full call, more than the 55% of tiles that hold a key some query may see. A key tile whose first "
             "key comes after the query tile's last query is masked entirely: do not compute it (stop the loop over "
             "key tiles there)")
    # 1024 keys, 64 tiles: a running sum kept in bfloat16 loses more at every tile (2.6-3.3 times SDPA's error over
    # 25 seeds, 1.5-1.8 with 256 keys); rounding only P to bfloat16 before P @ V, as SDPA's CPU kernel does, 1.2-1.3.
    # float16 too (the contract's): running values kept in float16 give 5.5-5.7 times SDPA's error
    for dtype, mantissa in ((torch.bfloat16, 8), (torch.float16, 11)):
        name = str(dtype).removeprefix("torch.")
        qb, kb, vb = (torch.randn(1, 2, T, 32, generator=g).to(dtype) for T in (64, 1024, 1024))
        exact = F.scaled_dot_product_attention(qb.double(), kb.double(), vb.double())
        out, lse = _attend(tiled_attention, qb, kb, vb, block_q=64, block_k=16, what=f"{name}, 1024 keys in tiles of 16")
        if out.dtype != dtype or lse.dtype != dtype:
            fail(f"out and lse should have q's dtype ({name}), got {out.dtype} and {lse.dtype}: keep the running values in "
                 "float32, then round out and lse to q's dtype at the end")
        ours = (out.double() - exact).abs().mean().item()
        sdpa = (F.scaled_dot_product_attention(qb, kb, vb).double() - exact).abs().mean().item()
        if ours > 1.5 * sdpa:
            fail(f"{name}, 1024 keys in tiles of 16: mean error {ours:.2g} against float64, {ours / sdpa:.1f} times SDPA's "
                 f"({sdpa:.2g}). Are the running max, sum and accumulator kept in {name}? Its {mantissa} bits of mantissa "
                 "lose a little at every key tile: keep them (and the scores) in float32 for float16 and bfloat16 alike, as "
                 "FlashAttention and SDPA do, and round only out and lse to q's dtype at the end")
    for what, bad in (("v with more rows than k", (q64, k64, torch.cat([v64, v64], -2))),
                      ("k with another head size than q", (q64, k64[..., :4], v64))):
        try:
            tiled_attention(*bad, None, False, 8, 8)
        except ValueError:
            continue
        except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
            fail(f"{what}: expected ValueError naming the argument, got {type(error).__name__}: {error}")
        fail(f"{what}: expected ValueError naming the argument, got a result (the contract refuses it: a v longer than k "
             "sliced to k's rows, or a head size cut to fit, would hide the caller's mistake)")
    passed("tiled_attention")

"""Visible checks of chapter 02 (multi-head attention and positions), and the oracles they compare against.

Oracles: ``torch.nn.MultiheadAttention`` (with the learner's weights copied in), a float64 formula for the
sinusoidal table and a float64 complex-number formula for RoPE; never course_lib's reference solutions.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .core import (assert_close, assert_finite, assert_rows_sum_to_one, assert_shape, assert_tensor, call_learner, fail,
                   passed, unpack_pair)

__all__ = ["check_heads", "check_multi_head_attention", "check_sinusoidal_encoding", "check_apply_rope",
           "torch_multihead_attention", "randomize_parameters", "sinusoidal_oracle", "rope_oracle",
           "assert_per_head_weights", "assert_weights_close", "assert_no_bias"]


def _close(actual, expected, tol: float = 1e-5) -> bool:
    return isinstance(actual, torch.Tensor) and actual.shape == expected.shape and bool(
        ((actual.double() - expected.double()).abs() <= tol + tol * expected.double().abs()).all())


# --- split and merge heads --------------------------------------------------------------

def _call_merge(merge_heads, x):
    try:
        return merge_heads(x)
    except RuntimeError as error:
        if "view" in str(error):
            fail(f"merge_heads raised RuntimeError: {str(error).splitlines()[0]} After transpose(1, 2) the tensor is not "
                 "contiguous in memory, so .view() cannot merge H and Dh: call .contiguous() first, or use .reshape()")
        raise


def check_heads(split_heads, merge_heads) -> None:
    """Visible checks for exercise 1: split_heads and merge_heads on a batch of 2, 3 positions, D = 8, H = 4."""
    gen = torch.Generator().manual_seed(201)
    x = torch.randn(2, 3, 8, generator=gen)
    heads = split_heads(x, 4)
    assert_shape(heads, (2, 4, 3, 2), "split_heads(x, 4) for x of shape (2, 3, 8)")
    expected = torch.stack(x.split(2, dim=-1), dim=1)  # head h = columns 2h, 2h+1 of every position
    if _close(heads, x.reshape(2, 4, 3, 2)) and not _close(heads, expected):
        fail("split_heads(x, 4) looks like x.view(B, H, T, Dh): that mixes positions and heads. View x as "
             "(B, T, H, Dh) first (head h = columns h*Dh ... (h+1)*Dh-1), then swap the T and H axes")
    assert_close(heads, expected, "split_heads(x, 4) (head h should hold columns 2h and 2h+1 of every position)")

    y = torch.randn(2, 4, 3, 2, generator=gen)  # a fresh (B, H, T, Dh) tensor, as attention returns it
    merged = _call_merge(merge_heads, y)
    assert_shape(merged, (2, 3, 8), "merge_heads(y) for y of shape (2, 4, 3, 2)")
    expected = torch.cat(y.unbind(dim=1), dim=-1)  # position t: head 0's Dh values, then head 1's, ...
    if _close(merged, y.reshape(2, 3, 8)) and not _close(merged, expected):
        fail("merge_heads(y) looks like y.reshape(B, T, H*Dh) without swapping the H and T axes back first: "
             "that mixes positions and heads")
    assert_close(merged, expected, "merge_heads(y) (position t should hold head 0's features, then head 1's, ...)")
    assert_close(_call_merge(merge_heads, split_heads(x, 4)), x, "merge_heads(split_heads(x, 4)), which should give x back,")
    passed("split_heads and merge_heads")


# --- multi-head attention ----------------------------------------------------------------

def randomize_parameters(module: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    """Overwrite every parameter with seeded N(0, scale^2) values (so checks do not depend on the global RNG)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * scale)
    return module


def torch_multihead_attention(module: nn.Module, dropout: float = 0.0) -> nn.MultiheadAttention:
    """A torch.nn.MultiheadAttention (batch_first, in eval mode, with this dropout on its attention weights once put
    in training mode) holding the weights of a module with W_q, W_k, W_v, W_o and n_heads.

    Beware its mask convention: a boolean attn_mask / key_padding_mask is True where attention is NOT allowed.
    """
    d_model, bias = module.W_q.in_features, module.W_q.bias is not None
    oracle = nn.MultiheadAttention(d_model, module.n_heads, dropout=dropout, bias=bias, batch_first=True)
    with torch.no_grad():
        oracle.in_proj_weight.copy_(torch.cat([module.W_q.weight, module.W_k.weight, module.W_v.weight]))
        oracle.out_proj.weight.copy_(module.W_o.weight)
        if bias:
            oracle.in_proj_bias.copy_(torch.cat([module.W_q.bias, module.W_k.bias, module.W_v.bias]))
            oracle.out_proj.bias.copy_(module.W_o.bias)
    return oracle.eval()


def _split(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, D) -> (B, H, T, Dh), head h = chunk h of the features (the checks' own, for diagnosis)."""
    return torch.stack(t.chunk(n_heads, dim=-1), dim=1)


def _merge(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh) (the checks' own, for diagnosis)."""
    return torch.cat(t.unbind(dim=1), dim=-1)


def _mha_weights_hint(module, x, weights) -> None:
    """Name the classic mistakes behind self-attention weights that differ from nn.MultiheadAttention's."""
    d_model, n_heads = module.W_q.in_features, module.n_heads
    with torch.no_grad():
        q, k = module.W_q(x).double(), module.W_k(x).double()
        scores = _split(q, n_heads) @ _split(k, n_heads).transpose(-2, -1) / math.sqrt(d_model // n_heads)
    if _close(weights, torch.softmax(scores, dim=-2), 1e-4):
        fail("your weights are a softmax over the queries (dim=-2): each key's column sums to 1 instead of each "
             "query's row. Take the softmax over the last axis, the keys")
    if _close(weights, torch.softmax(scores.transpose(-2, -1), dim=-1), 1e-4):
        fail("your weights are transposed: weights[b, h, i, j] must be query i's weight on key j, from the scores "
             "q @ k.transpose(-2, -1) (queries in rows, keys in columns)")
    with torch.no_grad():
        k_from_w_v = _split(module.W_v(x).double(), n_heads)
    if _close(weights, torch.softmax(_split(q, n_heads) @ k_from_w_v.transpose(-2, -1) / math.sqrt(d_model // n_heads), dim=-1), 1e-4):
        fail("your keys are projected with W_v (and, likely, your values with W_k): the projections are swapped. Keys are "
             "self.W_k(key), values self.W_v(value)")


def assert_per_head_weights(weights, shape: tuple, what: str) -> None:
    """Weights of shape (B, H, Tq, Tk) = `shape`; weights averaged over the heads, (B, Tq, Tk) or (B, 1, Tq, Tk), get
    their mistake named."""
    assert_tensor(weights, what)
    batch, n_heads, tq, tk = shape
    if tuple(weights.shape) in ((batch, tq, tk), (batch, 1, tq, tk)) and n_heads > 1:
        layout = "(B, Tq, Tk)" if weights.dim() == 3 else "(B, 1, Tq, Tk)"
        fail(f"{what} have shape {tuple(weights.shape)} = {layout}, one map for all {n_heads} heads: they look "
             f"averaged over the heads (nn.MultiheadAttention's default, average_attn_weights=True). Return the per-head "
             f"weights, {shape} = (B, H, Tq, Tk): weights[b, h] is head h's own map")
    assert_shape(weights, shape, what)


def assert_weights_close(weights, expected, what: str, **tolerance) -> None:
    """Attention weights against the expected per-head ones (B, H, Tq, Tk), for a test whose subject is not their
    shape (the scale, say): weights averaged over the heads, (B, Tq, Tk) or (B, 1, Tq, Tk), are compared with the heads'
    mean, so that this one mistake costs only the tests that grade the per-head shape."""
    if (isinstance(weights, torch.Tensor) and expected.dim() == 4 and expected.shape[1] > 1
            and (weights.dim() == 3 or (weights.dim() == 4 and weights.shape[1] == 1))):
        assert_close(weights, expected.mean(1, keepdim=weights.dim() == 4), f"{what} (averaged over the heads, as yours are)",
                     **tolerance)
    else:
        assert_close(weights, expected, what, **tolerance)


def assert_no_bias(module: nn.Module, d_model: int, what: str) -> None:
    """A module built with bias=False has W_q, W_k, W_v and W_o without biases: 4 D^2 parameters, not 4 D^2 + 4 D."""
    count = sum(p.numel() for p in module.parameters())
    with_bias = [name for name in ("W_q", "W_k", "W_v", "W_o") if getattr(module, name).bias is not None]
    if with_bias or count != 4 * d_model ** 2:
        fail(f"{what} has {count:,} parameters, expected 4 D^2 = {4 * d_model ** 2:,} (D = {d_model}): "
             + (f"{', '.join(with_bias)} still {'has a bias' if len(with_bias) == 1 else 'have biases'}. Pass bias on to "
                "each projection: nn.Linear(d_model, d_model, bias=bias)" if with_bias else
                "only the four (D, D) projection matrices may be parameters"))


def check_multi_head_attention(MultiHeadAttention) -> None:
    """Visible checks for exercise 2 against torch.nn.MultiheadAttention: self-attention without a mask, then
    cross-attention (3 queries, 6 keys) with a padding mask, a query with no key, and the ValueError of a d_model that
    n_heads does not divide."""
    d_model, n_heads = 16, 4
    module = randomize_parameters(MultiHeadAttention(d_model, n_heads), seed=202).eval()
    oracle = torch_multihead_attention(module)
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(203))
    with torch.no_grad():
        out, weights = unpack_pair(module(x, x, x), "MultiHeadAttention.forward", ("out", "weights"))
        expected_out, expected_weights = oracle(x, x, x, average_attn_weights=False)
    assert_per_head_weights(weights, (2, n_heads, 5, 5), "the weights for batch 2, 4 heads, 5 queries and 5 keys")
    assert_shape(out, (2, 5, d_model), "out for batch 2, 5 queries, d_model 16")
    _mha_weights_hint(module, x, weights)
    assert_rows_sum_to_one(weights, "your per-head weights")
    # How peaked are the weights compared with the expected ones? Unscaled or wrongly scaled scores show up here.
    ratio = (weights.double().log() - weights.double().log().mean(-1, keepdim=True)).std() / (
        expected_weights.double().log() - expected_weights.double().log().mean(-1, keepdim=True)).std()
    rescaled = torch.softmax(expected_weights.double().log() * ratio, dim=-1)
    if abs(ratio - 1) > 1e-3 and _close(weights, rescaled, 1e-4):
        d_head = d_model // n_heads
        fail(f"your weights are as peaked as scores scaled by {ratio.item() / math.sqrt(d_head):.4g}; the expected scale is "
             f"1/sqrt(d_head) = 1/sqrt({d_model}/{n_heads}) = {1 / math.sqrt(d_head):.4g}: each head's vectors have "
             f"d_head = d_model / n_heads features, not d_model")
    assert_close(weights, expected_weights, "your per-head attention weights (vs torch.nn.MultiheadAttention; "
                 "each head h uses columns h*Dh ... (h+1)*Dh-1 of W_q(query) and W_k(key), scores scaled by 1/sqrt(Dh))")
    if _close(out, _merge(weights.double() @ _split(module.W_v(x).double(), n_heads)), 1e-4):
        fail("your output is the merged heads without the output projection: return self.W_o(merge_heads(...))")
    with torch.no_grad():
        heads = weights.double() @ _split(module.W_v(x).double(), n_heads)  # (B, H, T, Dh), from your weights
        bias = None if module.W_o.bias is None else module.W_o.bias.double()
        scrambled = nn.functional.linear(heads.reshape(x.shape[0], x.shape[1], d_model), module.W_o.weight.double(), bias)
    if _close(out, scrambled, 1e-4):
        fail("your heads are merged in the wrong order: a view or reshape straight from (B, H, T, Dh) to (B, T, D) mixes "
             "positions and heads. Transpose back to (B, T, H, Dh) first: merge_heads(...)")
    assert_close(out, expected_out, "your output (vs torch.nn.MultiheadAttention with the same weights)")

    # cross-attention: queries from one sequence, keys and values from another, with a padding mask (True = attend)
    gen = torch.Generator().manual_seed(205)
    query, key, value = (torch.randn(2, length, d_model, generator=gen) for length in (3, 6, 6))
    keep = torch.tensor([[True] * 5 + [False], [True] * 4 + [False] * 2])  # (B, Tk): the last keys are padding
    with torch.no_grad():
        result = call_learner(lambda: module(query, key, value, keep[:, None, None, :]),
                              "cross-attention (3 queries; 6 keys and values; a padding mask of shape (2, 1, 1, 6))",
                              "the scores must be (B, H, Tq, Tk) = (2, 4, 3, 6): keys come from `key`, values from `value` "
                              "(self.W_k(key), self.W_v(value)), and nothing may assume Tq = Tk")
        out, weights = unpack_pair(result, "MultiHeadAttention.forward", ("out", "weights"))
        expected_out, expected_weights = oracle(query, key, value, key_padding_mask=~keep, average_attn_weights=False)
        unmasked = oracle(query, key, value, average_attn_weights=False)[1]
        inverted = oracle(query, key, value, key_padding_mask=keep, average_attn_weights=False)[1]
        values_from_key = oracle(query, key, key, key_padding_mask=~keep)[0]
        roles_swapped = oracle(query, value, key, key_padding_mask=~keep, average_attn_weights=False)[1]
    if isinstance(weights, torch.Tensor) and tuple(weights.shape) == (2, n_heads, 3, 3):
        fail("in cross-attention (3 queries, 6 keys) your weights have shape (2, 4, 3, 3), expected (2, 4, 3, 6): your keys "
             "come from `query`. Project keys from `key` and values from `value`: self.W_k(key), self.W_v(value)")
    assert_per_head_weights(weights, (2, n_heads, 3, 6), "the weights of cross-attention with 3 queries and 6 keys")
    if _close(weights, inverted):
        fail("with a padding mask your weights fall on the padding keys only: your mask is inverted. In this course (and in "
             "F.scaled_dot_product_attention) True means *may attend*; pass the mask to masked_softmax as it is")
    if _close(weights, unmasked):
        fail("with a padding mask (B, 1, 1, Tk) your weights are the same as without it: the mask never reaches the "
             "softmax. Pass it on: masked_softmax(scores, mask)")
    if _close(weights, unmasked * keep[:, None, None, :]):
        fail("with a padding mask your weights are the unmasked softmax with the masked keys zeroed afterwards: each query's "
             "weights no longer sum to 1. The mask goes into the softmax: masked_softmax(scores, mask)")
    if _close(weights, roles_swapped) and not _close(weights, expected_weights):
        fail("in cross-attention your keys come from `value` and your values from `key`: the roles are swapped. "
             "Keys are what a query is matched on, self.W_k(key); values are what is handed over, self.W_v(value)")
    assert_close(weights, expected_weights, "your weights of cross-attention with a padding mask (vs torch.nn.MultiheadAttention, "
                 "whose key_padding_mask is our mask inverted)")
    if _close(out, values_from_key):
        fail("in cross-attention your output uses `key` as the values: project the values from `value`, self.W_v(value)")
    assert_close(out, expected_out, "your output of cross-attention with a padding mask (vs torch.nn.MultiheadAttention)")

    # A query with no key to attend to (mask (B, 1, Tq, Tk), query 1 of batch 1 all False): weights 0, output W_o's bias
    none_for_one = keep[:, None, None, :].expand(2, 1, 3, 6).clone()
    none_for_one[1, 0, 1] = False
    with torch.no_grad():
        out, weights = unpack_pair(module(query, key, value, none_for_one), "MultiHeadAttention.forward", ("out", "weights"))
    assert_per_head_weights(weights, (2, n_heads, 3, 6), "the weights of cross-attention with a query that has no key")
    row, out_row = weights[1, :, 1], out[1, 1]
    if not (torch.isfinite(row).all() and torch.isfinite(out_row).all()):
        fail(f"with a mask (2, 1, 3, 6) that leaves query 1 of batch element 1 no key at all, your weights for that query "
             f"hold {int((~torch.isfinite(row)).sum())} NaN or infinite value(s) and its output {out_row[:4].tolist()}...; "
             "expected all-zero weights and the output W_o's bias. Scores filled with -inf give softmax 0/0 = NaN on such a "
             "row: use masked_softmax(scores, mask) (chapter 01), which gives a fully masked row all-zero weights")
    if (row != 0).any():
        fail(f"with a mask (2, 1, 3, 6) that leaves query 1 of batch element 1 no key at all, your weights for that query are "
             f"not all zero (the largest is {row.abs().max().item():.4g}): no key may get weight. Use masked_softmax(scores, "
             "mask) (chapter 01), which zeroes a fully masked row")
    assert_close(out_row, module.W_o.bias.detach(), "your output for a query with no key (expected W_o's bias: the heads are 0)")
    expected_out, expected_weights = oracle(query, key, value, key_padding_mask=~keep, average_attn_weights=False)
    others = torch.ones(2, 3, dtype=torch.bool)
    others[1, 1] = False
    assert_close(out[others], expected_out[others], "your output for the queries that have keys (vs torch.nn.MultiheadAttention)")
    try:
        MultiHeadAttention(10, 4)
    except ValueError:
        pass
    else:
        fail("MultiHeadAttention(10, 4) built a module: 4 heads do not divide d_model = 10. Raise ValueError naming d_model "
             "and n_heads")
    assert_no_bias(MultiHeadAttention(d_model, n_heads, bias=False), d_model, f"MultiHeadAttention({d_model}, {n_heads}, bias=False)")
    passed("MultiHeadAttention")


# --- sinusoidal table --------------------------------------------------------------------

def sinusoidal_oracle(max_len: int, d_model: int, frequency=None) -> torch.Tensor:
    """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(pos / 10000^(2i/d)), entry by entry in float64.

    ``frequency(j)``, if given, replaces column j's 10000^(-2i/d) (i = j // 2): the checks use it to recognise
    classic wrong exponents.
    """
    frequency = frequency or (lambda j: 10000 ** (-2 * (j // 2) / d_model))
    table = torch.empty(max_len, d_model, dtype=torch.float64)
    for pos in range(max_len):
        for j in range(d_model):
            angle = pos * frequency(j)
            table[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return table


def _sinusoidal_exponent_hint(table: torch.Tensor, d_model: int) -> None:
    """Name the classic wrong exponents of the sinusoidal table, or the first column whose frequency is wrong."""
    max_len = table.shape[0]
    wrong = {
        "you divide pos by 10000^(i/d) with i the pair index. The exponent is 2i/d (2i is the column of the pair's "
        "sine), so your frequencies fall only half as fast as they should": lambda j: 10000 ** (-(j // 2) / d_model),
        "you divide pos by 10000^(j/d) with j each column's own index, so the cosine column 2i+1 gets the exponent "
        "(2i+1)/d. Both columns of a pair share one angle, pos / 10000^(2i/d) with i = j // 2": lambda j: 10000 ** (-j / d_model),
        "you multiply pos by 10000^(2i/d). The angle is pos divided by it, pos * 10000^(-2i/d): the first pair turns "
        "by 1 radian per position, the later pairs more slowly": lambda j: 10000 ** (2 * (j // 2) / d_model),
    }
    for mistake, frequency in wrong.items():
        if _close(table, sinusoidal_oracle(max_len, d_model, frequency)):
            fail(f"your table has the wrong frequencies: {mistake}")
    expected = sinusoidal_oracle(max_len, d_model)
    for j in range(d_model):
        if not _close(table[:, j], expected[:, j]):
            i, value = j // 2, table[1, j].double().clamp(-1, 1).item()
            turn = math.asin(value) if j % 2 == 0 else math.acos(value)  # the angle at position 1 (all below pi/2 here)
            fail(f"column {j} ({'sin' if j % 2 == 0 else 'cos'} of pair i = {i}) of sinusoidal_encoding({max_len}, {d_model}) "
                 f"is wrong: at position 1 it holds {value:.6g}, the {'sine' if j % 2 == 0 else 'cosine'} of {turn:.6g} "
                 f"radians, expected {'sin' if j % 2 == 0 else 'cos'}(1 / 10000^({2 * i}/{d_model})) = {expected[1, j].item():.6g} "
                 f"(angle {10000 ** (-2 * i / d_model):.6g})")


def check_sinusoidal_encoding(sinusoidal_encoding) -> None:
    """Visible checks for exercise 3: the (6, 8) table."""
    table = assert_tensor(sinusoidal_encoding(6, 8), "sinusoidal_encoding(6, 8)")
    assert_shape(table, (6, 8), "sinusoidal_encoding(6, 8)")
    first_row = table[0].double()
    if _close(first_row, torch.tensor([1.0, 0.0] * 4)):
        fail(f"row 0 (position 0) of your table is {first_row.tolist()}: sin and cos are swapped. "
             "Even columns hold sin (sin 0 = 0), odd columns cos (cos 0 = 1)")
    if _close(first_row, torch.tensor([0.0] * 4 + [1.0] * 4)):
        fail(f"row 0 (position 0) of your table is {first_row.tolist()}: all sines first, then all cosines. "
             "This course uses the paper's interleaved layout: column 2i = sin, column 2i+1 = cos of the same angle")
    assert_finite(table, "sinusoidal_encoding(6, 8)")
    if not _close(table, sinusoidal_oracle(6, 8)):
        _sinusoidal_exponent_hint(table, 8)
    assert_close(table, sinusoidal_oracle(6, 8), "sinusoidal_encoding(6, 8)")
    passed("sinusoidal_encoding")


# --- RoPE ----------------------------------------------------------------------------------

def rope_oracle(x, positions=None, base: float = 10000.0, theta=None) -> torch.Tensor:
    """RoPE as complex numbers, in float64: z_i = x[2i] + j x[2i+1] becomes z_i * exp(j * pos * base^(-2i/Dh)).

    ``theta`` (Dh/2 float64 frequencies), if given, replaces base^(-2i/Dh): the checks use it to recognise wrong ones.
    """
    x64 = x.double()
    time, d_head = x.shape[-2], x.shape[-1]
    positions = torch.arange(time) if positions is None else positions
    if theta is None:
        theta = torch.tensor([base ** (-2 * i / d_head) for i in range(d_head // 2)], dtype=torch.float64)
    angle = positions.double()[..., None] * theta
    z = torch.complex(x64[..., 0::2], x64[..., 1::2]) * torch.polar(torch.ones_like(angle), angle)
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def _rope_rotate_half(x, positions=None, base: float = 10000.0) -> torch.Tensor:
    """The other convention (Hugging Face's rotate_half): feature i pairs with i + Dh/2. Used only to diagnose."""
    half = x.shape[-1] // 2
    order = torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()  # [0, h, 1, h+1, ...]
    rotated = rope_oracle(x[..., order], positions, base)
    return rotated[..., torch.argsort(order)]


def _rope_frequency_hint(x, out) -> None:
    """Name the classic wrong frequencies or positions behind apply_rope(x) (x (..., 5, 8), default positions)."""
    if _close(out, rope_oracle(x)):
        return
    i = torch.arange(4, dtype=torch.float64)  # the pair index, Dh = 8
    wrong = {
        "theta_i = 10000^(-i/Dh) with i the pair index: the exponent is 2i/Dh (2i is the column of the pair's first "
        "feature), so your frequencies fall only half as fast as they should": rope_oracle(x, theta=10000 ** (-i / 8)),
        "theta_i = 10000^(-4i/Dh): the exponent is doubled twice (arange(0, Dh, 2) already holds 2i)":
            rope_oracle(x, theta=10000 ** (-4 * i / 8)),
        "your frequencies are reversed: pair 0 must turn fastest (theta_0 = 1 radian per position) and the last pair "
        "slowest, theta_i = base^(-2i/Dh)": rope_oracle(x, theta=10000 ** (-2 * i / 8).flip(0)),
        "your positions start at 1: by default token t sits at position t, and token 0 is not rotated at all":
            rope_oracle(x, torch.arange(1, 6)),
    }
    for mistake, expected in wrong.items():
        if _close(out, expected):
            fail(f"apply_rope(x) is RoPE with the wrong angles: {mistake}")


def check_apply_rope(apply_rope) -> None:
    """Visible checks for exercise 4: x of shape (1, 2, 5, 8) at the default positions 0 ... 4."""
    x = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(204))
    out = assert_tensor(apply_rope(x), "apply_rope(x)")
    assert_shape(out, x.shape, "apply_rope(x) for x of shape (1, 2, 5, 8)")
    norm_change = (out.double().norm(dim=-1) - x.double().norm(dim=-1)).abs().max().item()
    if norm_change > 1e-4:
        fail(f"apply_rope changed the length of a vector by up to {norm_change:.4g}; a rotation keeps lengths. "
             "Rotate each pair (a, b) by angle t: (a cos t - b sin t, a sin t + b cos t)")
    expected = rope_oracle(x)
    if _close(out, _rope_rotate_half(x)) and not _close(out, expected):
        fail("you paired feature i with feature i + Dh/2 (Hugging Face's rotate_half convention); this course "
             "rotates the interleaved pairs (0, 1), (2, 3), ... as the RoFormer paper does")
    if _close(out, rope_oracle(x, -torch.arange(5))) and not _close(out, expected):
        fail("your rotation goes the wrong way: position p turns the pair (a, b) counter-clockwise, to "
             "(a cos t - b sin t, a sin t + b cos t) with t = p * theta_i")
    _rope_frequency_hint(x, out)
    assert_close(out, expected.float(), "apply_rope(x) (vs the complex-number formula)")
    positions = torch.tensor([7, 3, 0, 12, 5])  # not 0..T-1: as for tokens after a cache, or in another order
    moved = assert_tensor(apply_rope(x, positions), "apply_rope(x, positions)")
    if _close(moved, out) and not _close(moved, rope_oracle(x, positions)):
        fail("apply_rope(x, positions) gives the same result as apply_rope(x): your function ignores `positions` and "
             "rotates by 0, 1, ..., T-1 always; token t must turn by positions[t] * theta_i (a cached decode step's "
             "token sits at position P, not 0)")
    assert_close(moved, rope_oracle(x, positions).float(), "apply_rope(x, positions) for positions 7, 3, 0, 12, 5")
    other_base = assert_tensor(apply_rope(x, base=100.0), "apply_rope(x, base=100.0)")
    if _close(other_base, rope_oracle(x)) and not _close(other_base, rope_oracle(x, base=100.0)):
        fail("apply_rope(x, base=100.0) gives the same result as apply_rope(x): `base` is ignored (10000 is hard-coded). "
             "theta_i = base^(-2i/Dh) with the `base` argument (long-context models raise it)")
    assert_close(other_base, rope_oracle(x, base=100.0).float(), "apply_rope(x, base=100.0) (theta_i = 100^(-2i/Dh))")
    # one row of positions per sequence, (B, 1, T): as when each sequence of a batch starts at its own offset
    batch = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(206))
    per_row = torch.tensor([[0, 1, 2, 3, 4], [6, 7, 8, 9, 10]]).view(2, 1, 5)
    name = "apply_rope(x, positions) for x (2, 2, 5, 8) and positions (2, 1, 5)"
    rotated = assert_tensor(call_learner(lambda: apply_rope(batch, per_row), name,
                                         "positions may have leading dimensions that broadcast against x.shape[:-1]: "
                                         "compute the angles as positions[..., None] * theta, shape (..., T, Dh/2)"), name)
    assert_shape(rotated, batch.shape, name)
    expected = rope_oracle(batch, per_row)
    if not _close(rotated, expected):
        for b in range(2):
            for flat in (rope_oracle(batch[b], per_row[0, 0]), rope_oracle(batch[b], per_row[1, 0])):
                if _close(rotated[b], flat) and not _close(rotated[b], expected[b]):
                    fail(f"apply_rope(x, positions) with positions (2, 1, 5) (sequence 0 at positions 0..4, sequence 1 at "
                         f"6..10) rotates sequence {b} by the other sequence's positions: keep the batch dimension of "
                         "`positions` (do not flatten it); the angles are positions[..., None] * theta, which broadcasts")
    assert_close(rotated, expected.float(), "apply_rope(x, positions) for positions (2, 1, 5), one row per sequence")
    passed("apply_rope")

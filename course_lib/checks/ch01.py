"""Visible checks of chapter 01 (attention), and the float64 oracles they compare against."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .ch02 import randomize_parameters
from .core import (assert_close, assert_masked_are_zero, assert_rows_sum_to_one, assert_shape, call_learner, fail, passed,
                   unpack_pair)

__all__ = ["check_masked_softmax", "check_additive_attention", "check_scaled_dot_product_attention", "additive_attention_oracle",
           "check_attention_decoder", "attention_decoder_oracle", "assert_same_tokens"]


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
    _check_fully_masked_row(masked_softmax(scores, _WITH_A_FULLY_MASKED_ROW), "masked_softmax(scores, mask)")
    passed("masked_softmax")


#: Row 1 has no key to attend to (a sequence whose keys are all padding): its weights must be all zero.
_WITH_A_FULLY_MASKED_ROW = torch.tensor([[True, True, False, False, False], [False] * 5, [True] * 5])


def _check_fully_masked_row(weights, name: str) -> None:
    """Row 1 of ``weights`` (under ``_WITH_A_FULLY_MASKED_ROW``) is all zeros: not NaN, not uniform."""
    row = weights[1]
    if not torch.isfinite(row).all():
        fail(f"{name} with a fully masked row (row 1: every key masked) gives {row.tolist()}; expected all zeros. "
             "A row of -inf scores has softmax 0/0 = NaN: fill masked scores with a large finite negative number "
             "and set the masked weights to 0")
    if (row != 0).any():
        fail(f"{name} with a fully masked row (row 1: every key masked) gives {row.tolist()}; expected all zeros "
             "(no key may get weight, so the row sums to 0, not 1): set the masked weights to 0 after the softmax")


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


def _name_the_wrong_formula(weights, query, keys, W_q, W_k, v) -> None:
    """If ``weights`` are those of a classic wrong score formula, fail naming it (float64 oracles of each)."""
    q, k = (query.double() @ W_q.double()).unsqueeze(-2), (keys.double() @ W_k.double()).unsqueeze(-3)
    wrong = {
        "v . (W_q q + W_k k), without the tanh": (q + k) @ v.double(),
        "v . (tanh(W_q q) + tanh(W_k k)), the tanh applied to each projection alone": (q.tanh() + k.tanh()) @ v.double(),
        "tanh(W_q q) . tanh(W_k k) summed without v": (q.tanh() * k.tanh()).sum(-1),
    }
    for formula, energies in wrong.items():
        if torch.allclose(weights.double(), torch.softmax(energies, dim=-1), rtol=1e-4, atol=1e-6):
            fail(f"your attention weights are softmax({formula}); additive attention scores each pair (query i, key j) "
                 "with v . tanh(W_q q_i + W_k k_j): add the two projections, then tanh, then the dot product with v")
    columns = torch.softmax(((q + k).tanh() @ v.double()), dim=0)
    if torch.allclose(weights.double(), columns, rtol=1e-4, atol=1e-6):
        fail("your attention weights are normalised over the queries (each column sums to 1); each query's weights "
             "over the keys must sum to 1: softmax over the last axis")


def check_additive_attention(additive_attention) -> None:
    """Visible checks for chapter 01, exercise 2: no mask, then a padding mask (the hidden tests add batches)."""
    gen = torch.Generator().manual_seed(102)
    query, keys, values = torch.randn(2, 3, generator=gen), torch.randn(4, 5, generator=gen), torch.randn(4, 6, generator=gen)
    W_q, W_k, v = torch.randn(3, 7, generator=gen), torch.randn(5, 7, generator=gen), torch.randn(7, generator=gen)
    context, weights = unpack_pair(additive_attention(query, keys, values, W_q, W_k, v), "additive_attention", ("context", "weights"))
    assert_shape(weights, (2, 4), "weights for 2 queries and 4 keys")
    assert_shape(context, (2, 6), "context for 2 queries and values of size 6")
    assert_rows_sum_to_one(weights)
    expected_context, expected_weights = additive_attention_oracle(query, keys, values, W_q, W_k, v)
    _name_the_wrong_formula(weights, query, keys, W_q, W_k, v)
    assert_close(weights, expected_weights, "your attention weights")
    assert_close(context, expected_context, "your context vectors")
    mask = torch.tensor([True, True, True, False])  # key 3 is padding; True = keep
    context, weights = unpack_pair(additive_attention(query, keys, values, W_q, W_k, v, mask), "additive_attention",
                                   ("context", "weights"))
    assert_shape(weights, (2, 4), "weights for 2 queries and 4 keys with a padding mask")
    if (weights.detach()[:, 3] != 0).any():
        fail(f"with a padding mask (True = keep; key 3 masked) your weights give key 3 {weights[:, 3].tolist()}; a masked "
             "key must get exactly 0. Is the mask ignored or inverted? Pass it on: masked_softmax(energies, mask)")
    expected_context, expected_weights = additive_attention_oracle(query, keys, values, W_q, W_k, v, mask)
    assert_close(weights, expected_weights, "your attention weights with a padding mask (key 3 masked)")
    assert_close(context, expected_context, "your context vectors with a padding mask (key 3 masked)")
    passed("additive_attention")


def check_scaled_dot_product_attention(scaled_dot_product_attention) -> None:
    """Visible checks for chapter 01, exercise 4, against torch.nn.functional.scaled_dot_product_attention."""
    gen = torch.Generator().manual_seed(103)
    q, k, v = torch.randn(4, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(6, 3, generator=gen)
    out, weights = unpack_pair(scaled_dot_product_attention(q, k, v), "scaled_dot_product_attention", ("out", "weights"))
    assert_shape(weights, (4, 6), "weights for 4 queries and 6 keys")
    assert_shape(out, (4, 3), "out for 4 queries and values of size 3")
    assert_rows_sum_to_one(weights)
    expected_weights = torch.softmax(q.double() @ k.double().T / math.sqrt(8), dim=-1)
    ratio = (weights.double().log() - weights.double().log().mean(-1, keepdim=True)).std() / (
        expected_weights.log() - expected_weights.log().mean(-1, keepdim=True)
    ).std()
    if abs(ratio - 1) > 1e-3:
        fail(
            f"your weights are as peaked as scores scaled by {1 / math.sqrt(8) * ratio.item():.4g}; the expected scale is "
            f"1/sqrt(d_k) = 1/sqrt(8) = {1 / math.sqrt(8):.4g} (d_k is the size of a query/key vector, q.shape[-1])"
        )
    assert_close(weights, expected_weights, "your attention weights")
    assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), "your output")
    mask = torch.tensor([True, True, True, False, False, False])  # keys 3, 4, 5 are padding; True = keep
    out, weights = unpack_pair(scaled_dot_product_attention(q, k, v, mask), "scaled_dot_product_attention", ("out", "weights"))
    assert_masked_are_zero(weights, mask.expand(4, 6), "your attention weights with a padding mask (True = keep)")
    assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                 "your output with a padding mask")
    # Query 2 may attend to no key at all (as a sequence that is all padding): its weights and output must be 0.
    no_keys = mask.expand(4, 6).clone()
    no_keys[2] = False
    out, weights = unpack_pair(scaled_dot_product_attention(q, k, v, no_keys), "scaled_dot_product_attention", ("out", "weights"))
    row, out_row = weights.detach()[2], out.detach()[2]
    if not (torch.isfinite(row).all() and torch.isfinite(out_row).all()):
        fail(f"with a mask that leaves query 2 no key at all, your weights for query 2 are {row.tolist()} and its output "
             f"{out_row.tolist()}; expected all zeros. Scores filled with -inf give softmax 0/0 = NaN on such a row: "
             "call your masked_softmax(scores, mask) from exercise 1, which gives a fully masked row all-zero weights")
    if (row != 0).any():
        fail(f"with a mask that leaves query 2 no key at all, your weights for query 2 are {row.tolist()}; expected all "
             "zeros (no key may get weight): call your masked_softmax(scores, mask) from exercise 1 and check that it "
             "passes its own visible check")
    expected_weights = _softmax64(q.double() @ k.double().T / math.sqrt(8), no_keys)
    assert_close(weights, expected_weights, "your attention weights with a mask that leaves query 2 no key")
    assert_close(out, expected_weights @ v.double(), "your output with a mask that leaves query 2 no key (its output must be 0)")
    passed("scaled_dot_product_attention")


# --- exercise 3: the attention decoder of the GRU translator ------------------------------------------------------


def _additive_weights64(query, enc_states, attention, src_mask):
    """Float64 additive-attention weights (B, S) of queries (B, Dq) over enc_states (B, S, Dk), padding masked."""
    hidden = torch.tanh((query.double() @ attention.W_q.double()).unsqueeze(1) + enc_states.double() @ attention.W_k.double())
    return _softmax64(hidden @ attention.v.double(), src_mask)


def attention_decoder_oracle(model, token, state, enc_states, src_mask):
    """Float64 reference of one step of GRUSeq2Seq's attention decoder, from torch built-ins: F.embedding, the
    additive attention of the state before the step (float64 softmax over the real positions), torch.nn.GRUCell
    holding model.decoder's weights, F.linear. Returns (logits (B, V), new state (B, H), weights (B, S)), float64."""
    with torch.no_grad():
        emb = F.embedding(token, model.embed.weight.double())  # (B, E)
        weights = _additive_weights64(state, enc_states, model.attention, src_mask)  # (B, S)
        context = (weights.unsqueeze(1) @ enc_states.double()).squeeze(1)  # (B, 2H)
        cell = torch.nn.GRUCell(model.decoder.input_size, model.decoder.hidden_size).double()
        cell.load_state_dict(model.decoder.state_dict())
        new_state = cell(torch.cat([emb, context], dim=-1), state.double())  # (B, H)
        logits = F.linear(torch.cat([new_state, context, emb], dim=-1), model.readout.weight.double(), model.readout.bias.double())
    return logits, new_state, weights


def _unpack_step(result):
    if not isinstance(result, tuple) or len(result) != 3:
        fail(f"decoder_step should return a tuple (logits, new state, weights), got {type(result).__name__}"
             + (f" of length {len(result)}" if isinstance(result, tuple) else ""))
    return result


def _close(a, b) -> bool:
    return torch.allclose(a.detach().double(), b.double(), rtol=1e-5, atol=1e-5)


def _name_the_wrong_gru(new_state, model, token, state, enc_states, src_mask) -> None:
    """Fail naming a classic wrong GRU update when new_state is one (float64 versions of each)."""
    _, _, weights = attention_decoder_oracle(model, token, state, enc_states, src_mask)
    context = (weights.unsqueeze(1) @ enc_states.double()).squeeze(1)
    x = torch.cat([F.embedding(token, model.embed.weight.double()), context], dim=-1)
    gru, h = model.decoder, state.double()
    w_ir, w_iz, w_in = gru.weight_ih.double().chunk(3)
    w_hr, w_hz, w_hn = gru.weight_hh.double().chunk(3)
    b_ir, b_iz, b_in = gru.bias_ih.double().chunk(3)
    b_hr, b_hz, b_hn = gru.bias_hh.double().chunk(3)
    r, z = torch.sigmoid(x @ w_ir.T + b_ir + h @ w_hr.T + b_hr), torch.sigmoid(x @ w_iz.T + b_iz + h @ w_hz.T + b_hz)
    n = torch.tanh(x @ w_in.T + b_in + r * (h @ w_hn.T + b_hn))
    wrong = {
        "z * n + (1 - z) * h, the update gate on the wrong side": z * n + (1 - z) * h,
        "n from r * h before its matrix, tanh(W_in x + b_in + W_hn (r * h) + b_hn), the paper's form, not torch.nn.GRUCell's":
            (1 - z) * torch.tanh(x @ w_in.T + b_in + (r * h) @ w_hn.T + b_hn) + z * h,
        "the gates in the order (z, r, n): weight_ih and weight_hh hold them as (r, z, n)":
            (1 - r) * torch.tanh(x @ w_in.T + b_in + z * (h @ w_hn.T + b_hn)) + r * h,
    }
    for formula, candidate in wrong.items():
        if _close(new_state, candidate):
            fail(f"your new state is {formula}. torch.nn.GRUCell computes r = sigmoid(W_ir x + b_ir + W_hr h + b_hr), "
                 "z likewise, n = tanh(W_in x + b_in + r * (W_hn h + b_hn)), h' = (1 - z) * n + z * h")


def _check_step(decoder_step) -> None:
    """One step of a small GRUSeq2Seq with random weights, against the float64 oracle; names the main mistakes."""
    from course_lib.data import PAD
    from course_lib.seq2seq import GRUSeq2Seq

    model = randomize_parameters(GRUSeq2Seq(emb_dim=6, hidden=8, use_attention=True), seed=104, scale=0.5).eval()
    gen = torch.Generator().manual_seed(104)
    lengths = torch.tensor([5, 3, 2])
    src = torch.randint(3, 13, (3, 5), generator=gen).masked_fill(torch.arange(5) >= lengths[:, None], PAD)
    token, state = torch.randint(3, 13, (3,), generator=gen), torch.randn(3, 8, generator=gen)
    with torch.no_grad():
        enc_states, _ = model.encode(src, lengths)
    src_mask = src != PAD
    result = call_learner(lambda: decoder_step(model, token, state, enc_states, src_mask),
                          "decoder_step(model, token, state, enc_states, src_mask) for B = 3, S = 5, E = 6, H = 8",
                          "the docstring states each shape and the layout of the concatenations")
    logits, new_state, weights = _unpack_step(result)
    assert_shape(weights, (3, 5), "decoder_step's weights for B = 3 strings of S = 5 positions")
    assert_shape(new_state, (3, 8), "decoder_step's new state for B = 3 and H = 8")
    assert_shape(logits, (3, 13), "decoder_step's logits for B = 3 and a vocabulary of 13")
    expected_logits, expected_state, expected_weights = attention_decoder_oracle(model, token, state, enc_states, src_mask)
    weights = weights.detach()
    if (weights[~src_mask] != 0).any():
        fail(f"your weights give the padding of string 2 (length 2, positions 2 to 4) {weights[2, 2:].tolist()}; padding must "
             "get exactly 0. Is src_mask passed on to the attention (True on real positions)?")
    if _close(weights, _additive_weights64(expected_state, enc_states, model.attention, src_mask)):
        fail("your attention weights are those of the NEW state as the query; the query is the state before this step "
             "(the state the previous token left): attend first, then update the state with the context")
    assert_close(weights, expected_weights, "your attention weights (query: the state before this step)")
    _name_the_wrong_gru(new_state, model, token, state, enc_states, src_mask)
    assert_close(new_state, expected_state,
                 "your new state, compared with torch.nn.GRUCell holding model.decoder's weights fed torch.cat([embedding, context])")
    context = (expected_weights.unsqueeze(1) @ enc_states.double()).squeeze(1)
    emb = F.embedding(token, model.embed.weight.double())
    readout = model.readout.weight.double(), model.readout.bias.double()
    if _close(logits, F.linear(torch.cat([state.double(), context, emb], dim=-1), *readout)):
        fail("your logits are the readout of the state before this step; the readout reads the NEW state: "
             "model.readout(torch.cat([new state, context, embedding]))")
    assert_close(logits, expected_logits, "your logits, compared with model.readout(torch.cat([new state, context, embedding]))")


def assert_same_tokens(actual, expected, name: str) -> None:
    """Token ids equal, exactly (no tolerance: they are integers); the message names the first entry that differs."""
    assert_shape(actual, expected.shape, name)
    if actual.is_floating_point():
        fail(f"{name} are {actual.dtype} numbers: token ids are integers (argmax returns int64)")
    wrong = (actual != expected).nonzero()
    if len(wrong):
        where = tuple(int(i) for i in wrong[0])
        fail(f"{name} differ in {len(wrong)} of {actual.numel()} entries; the first at index {where}: token "
             f"{int(actual[where])}, expected {int(expected[where])}")


def _check_translation(greedy_translate) -> None:
    """The shipped, trained translator on six strings: the same tokens and weights as the course's model."""
    from course_lib import assets
    from course_lib.data import digits_to_text, reversal_batch

    model = assets.load("gru-reversal-attention")
    batch = reversal_batch(6, generator=torch.Generator().manual_seed(105))
    max_len = batch.tgt.shape[1]
    with torch.no_grad():
        expected_tokens, expected_weights = model.greedy_decode(batch.src, batch.src_lengths, max_len)
        result = call_learner(lambda: greedy_translate(model, batch.src, batch.src_lengths, max_len),
                              f"greedy_translate(model, src, src_lengths, max_len={max_len}) for 6 strings")
    tokens, weights = unpack_pair(result, "greedy_translate", ("tokens", "weights"))
    assert_shape(tokens, (6, max_len), f"greedy_translate's tokens for 6 strings and max_len = {max_len}")
    assert_shape(weights, (6, max_len, batch.src.shape[1]), f"greedy_translate's weights for 6 strings of {batch.src.shape[1]} positions")
    wrong = (tokens != expected_tokens).nonzero()
    if len(wrong):
        row, step = (int(i) for i in wrong[0])
        fail(f"translating {digits_to_text(batch.src[row])!r}, step {step} of your greedy_translate writes token "
             f"{int(tokens[row, step])} where the course's model writes {int(expected_tokens[row, step])} (its tokens: "
             f"{expected_tokens[row].tolist()}, yours: {tokens[row].tolist()}). Each step's input is the previous step's "
             "argmax, the first is BOS, and the first state is tanh(model.bridge(summary))")
    assert_close(weights, expected_weights, "greedy_translate's attention weights, compared with the course's model")


def check_attention_decoder(decoder_step, greedy_translate) -> None:
    """Visible checks for chapter 01, exercise 3: one step of a small random model against a float64 reference built
    from torch built-ins, then the trained translator against the course's model (the hidden tests add the rest)."""
    _check_step(decoder_step)
    _check_translation(greedy_translate)
    passed("attention decoder")

"""The learner-facing checks: the reference passes; each classic bug gets a specific message."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import attention, checks, seq2seq
from course_lib.data import BOS, PAD


def softmax_wrong_axis(scores, mask=None):
    return torch.softmax(scores, dim=0)


def softmax_ignoring_mask(scores, mask=None):
    return torch.softmax(scores, dim=-1)


def softmax_inverted_mask(scores, mask=None):
    return attention.masked_softmax(scores, None if mask is None else ~mask)


def sdpa_unscaled(q, k, v, mask=None):
    weights = attention.masked_softmax(q @ k.transpose(-2, -1), mask)
    return weights @ v, weights


def sdpa_scaled_by_d(q, k, v, mask=None):
    weights = attention.masked_softmax(q @ k.transpose(-2, -1) / q.shape[-1], mask)
    return weights @ v, weights


def sdpa_output_only(q, k, v, mask=None):
    return attention.scaled_dot_product_attention(q, k, v, mask)[0]


def additive_without_tanh(query, keys, values, W_q, W_k, v, mask=None):
    energies = ((query @ W_q).unsqueeze(-2) + (keys @ W_k).unsqueeze(-3)) @ v
    weights = attention.masked_softmax(energies, mask)
    return weights @ values, weights


def softmax_nan_on_fully_masked(scores, mask=None):
    if mask is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def softmax_uniform_on_fully_masked(scores, mask=None):
    if mask is None:
        return torch.softmax(scores, dim=-1)
    return torch.softmax(scores.masked_fill(~mask, -1e9), dim=-1)


def sdpa_inverted_mask(q, k, v, mask=None):
    return attention.scaled_dot_product_attention(q, k, v, None if mask is None else ~mask)


def sdpa_mask_ignored(q, k, v, mask=None):
    return attention.scaled_dot_product_attention(q, k, v)


def additive_tanh_each(query, keys, values, W_q, W_k, v, mask=None):
    energies = ((query @ W_q).tanh().unsqueeze(-2) + (keys @ W_k).tanh().unsqueeze(-3)) @ v
    weights = attention.masked_softmax(energies, mask)
    return weights @ values, weights


def additive_mask_ignored(query, keys, values, W_q, W_k, v, mask=None):
    energies = torch.tanh((query @ W_q)[..., :, None, :] + (keys @ W_k)[..., None, :, :]) @ v
    weights = torch.softmax(energies, -1)
    return weights @ values, weights


def sdpa_nan_on_fully_masked(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, -1)
    return weights @ v, weights


def sdpa_uniform_on_fully_masked(q, k, v, mask=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e9)
    weights = torch.softmax(scores, -1)
    return weights @ v, weights


def pytorch_gru(gates_x, gates_h, state, weight_hn, bias_hn):
    r, z = torch.sigmoid(gates_x[0] + gates_h[0]), torch.sigmoid(gates_x[1] + gates_h[1])
    return (1 - z) * torch.tanh(gates_x[2] + r * gates_h[2]) + z * state


def gru_update_gate_swapped(gates_x, gates_h, state, weight_hn, bias_hn):
    r, z = torch.sigmoid(gates_x[0] + gates_h[0]), torch.sigmoid(gates_x[1] + gates_h[1])
    return z * torch.tanh(gates_x[2] + r * gates_h[2]) + (1 - z) * state


def gru_reset_before_matrix(gates_x, gates_h, state, weight_hn, bias_hn):
    r, z = torch.sigmoid(gates_x[0] + gates_h[0]), torch.sigmoid(gates_x[1] + gates_h[1])
    return (1 - z) * torch.tanh(gates_x[2] + (r * state) @ weight_hn.T + bias_hn) + z * state


def gru_gates_z_r_n(gates_x, gates_h, state, weight_hn, bias_hn):
    z, r = torch.sigmoid(gates_x[0] + gates_h[0]), torch.sigmoid(gates_x[1] + gates_h[1])
    return (1 - z) * torch.tanh(gates_x[2] + r * gates_h[2]) + z * state


def decoder_step_with(gru_update=pytorch_gru, query="previous", readout="new", masked=True):
    """A decoder step with one part chosen: the GRU update, the query's state, the readout's state, the mask."""
    def step(model, token, state, enc_states, src_mask):
        emb, a, cell = model.embed(token), model.attention, model.decoder

        def attend(query_state):
            context, weights = attention.additive_attention(query_state.unsqueeze(1), enc_states, enc_states, a.W_q, a.W_k, a.v,
                                                            src_mask.unsqueeze(1) if masked else None)
            return context.squeeze(1), weights.squeeze(1)

        context, weights = attend(state)
        gates_x = (torch.cat([emb, context], -1) @ cell.weight_ih.T + cell.bias_ih).chunk(3, -1)
        gates_h = (state @ cell.weight_hh.T + cell.bias_hh).chunk(3, -1)
        new_state = gru_update(gates_x, gates_h, state, cell.weight_hh.chunk(3)[2], cell.bias_hh.chunk(3)[2])
        if query == "new":
            context, weights = attend(new_state)
        logits = model.readout(torch.cat([new_state if readout == "new" else state, context, emb], -1))
        return logits, new_state, weights
    return step


def translate_without_feedback(model, src, src_lengths, max_len):
    enc_states, summary = model.encode(src, src_lengths)
    state, token = torch.tanh(model.bridge(summary)), torch.full((src.shape[0],), BOS)
    tokens, weights = [], []
    for _ in range(max_len):
        logits, state, step_weights = seq2seq.decoder_step(model, token, state, enc_states, src != PAD)
        tokens.append(logits.argmax(-1))
        weights.append(step_weights)
    return torch.stack(tokens, 1), torch.stack(weights, 1)


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_additive_attention, additive_mask_ignored, r"padding mask \(True = keep; key 3 masked\) your weights give key 3 .* ignored or inverted"),
    (checks.check_scaled_dot_product_attention, sdpa_nan_on_fully_masked, r"query 2 no key at all.*nan.*0/0 = NaN.*masked_softmax"),
    (checks.check_scaled_dot_product_attention, sdpa_uniform_on_fully_masked, r"query 2 no key at all.*expected all zeros \(no key may get weight\).*masked_softmax"),
    (checks.check_masked_softmax, softmax_nan_on_fully_masked, r"fully masked row .* nan.*0/0 = NaN"),
    (checks.check_masked_softmax, softmax_uniform_on_fully_masked, r"fully masked row .* expected all zeros \(no key may get weight"),
    (checks.check_scaled_dot_product_attention, sdpa_inverted_mask, r"with a padding mask \(True = keep\) give weight .* masked position"),
    (checks.check_scaled_dot_product_attention, sdpa_mask_ignored, r"with a padding mask \(True = keep\) give weight .* masked position"),
    (checks.check_additive_attention, additive_tanh_each, r"tanh applied to each projection alone"),
    (checks.check_masked_softmax, softmax_wrong_axis, r"row 0 of your weights \(no mask\) sums to 1\.\d+, expected 1 \(is the softmax taken over the last axis"),
    (checks.check_masked_softmax, softmax_ignoring_mask, r"give weight 0\.\d+ to a masked position \(0, 3\).*ignored or inverted"),
    (checks.check_masked_softmax, softmax_inverted_mask, r"masked position .*ignored or inverted"),
    (checks.check_scaled_dot_product_attention, sdpa_unscaled, rf"scores scaled by 1; the expected scale is 1/sqrt\(d_k\) = 1/sqrt\(8\) = {1 / math.sqrt(8):.4f}"),
    (checks.check_scaled_dot_product_attention, sdpa_scaled_by_d, rf"scores scaled by {1 / 8:.4g}; the expected scale"),
    (checks.check_scaled_dot_product_attention, sdpa_output_only, r"should return a tuple \(out, weights\), got Tensor"),
    (checks.check_additive_attention, additive_without_tanh, r"softmax\(v \. \(W_q q \+ W_k k\), without the tanh\)"),
])
def test_classic_bugs_get_specific_messages(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_assert_close_names_the_worst_entry():
    expected = torch.zeros(2, 3)
    actual = expected.clone()
    actual[1, 2] = 0.5
    with pytest.raises(checks.CheckFailed, match=r"in 1 of 6 entries; the worst is at index \(1, 2\): got 0\.5, expected 0"):
        checks.assert_close(actual, expected, "x")


def test_assert_finite_reports_nan():
    with pytest.raises(checks.CheckFailed, match=r"contains 1 non-finite value\(s\), the first at index \(0, 1\): nan"):
        checks.assert_finite(torch.tensor([[0.0, float("nan")]]), "w")


def test_call_learner_names_the_call_and_lets_an_unfinished_exercise_through():
    from course_lib.checks.core import call_learner

    def shape_error():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)\nmore detail")

    def unfinished():
        raise NotImplementedError("exercise 1: your code here")

    assert call_learner(lambda: 7, "f(x)") == 7
    with pytest.raises(checks.CheckFailed, match=r"^f\(x\) raised RuntimeError: mat1 and mat2 shapes cannot be multiplied "
                                                r"\(2x3 and 4x5\) \(use x @ w\.T\)$"):
        call_learner(shape_error, "f(x)", "use x @ w.T")
    with pytest.raises(NotImplementedError, match="your code here"):  # a RuntimeError subclass, yet not the learner's bug
        call_learner(unfinished, "f(x)", errors=Exception)
    with pytest.raises(ValueError):  # not among `errors`: raised as itself
        call_learner(lambda: int("x"), "f(x)")
    with pytest.raises(checks.CheckFailed, match=r"raised ValueError: invalid literal"):
        call_learner(lambda: int("x"), "f(x)", errors=Exception)


def test_no_two_chapters_export_the_same_check():
    """course_lib.checks re-exports every chapter with `import *`: a name two chapters export would
    silently shadow the earlier one, and a notebook would run the other chapter's check."""
    import importlib
    import pkgutil

    import course_lib.checks

    owners: dict[str, str] = {}
    for info in pkgutil.iter_modules(course_lib.checks.__path__):
        if info.name.startswith("ch"):
            module = importlib.import_module(f"course_lib.checks.{info.name}")
            for name in module.__all__:
                assert name not in owners, f"{name} is exported by both {owners[name]} and {info.name}"
                owners[name] = info.name
    assert len({o for o in owners.values()}) >= 7


@pytest.mark.parametrize("decoder_step,greedy_translate,message", [
    (decoder_step_with(masked=False), seq2seq.greedy_translate, r"your weights give the padding of string 2 .* padding must get exactly 0\. Is src_mask passed on"),
    (decoder_step_with(query="new"), seq2seq.greedy_translate, r"weights are those of the NEW state as the query; the query is the state before this step"),
    (decoder_step_with(gru_update_gate_swapped), seq2seq.greedy_translate, r"new state is z \* n \+ \(1 - z\) \* h, the update gate on the wrong side"),
    (decoder_step_with(gru_reset_before_matrix), seq2seq.greedy_translate, r"new state is n from r \* h before its matrix"),
    (decoder_step_with(gru_gates_z_r_n), seq2seq.greedy_translate, r"new state is the gates in the order \(z, r, n\)"),
    (decoder_step_with(readout="previous"), seq2seq.greedy_translate, r"logits are the readout of the state before this step; the readout reads the NEW state"),
    (lambda *args: seq2seq.decoder_step(*args)[:2], seq2seq.greedy_translate, r"decoder_step should return a tuple \(logits, new state, weights\), got tuple of length 2"),
    (seq2seq.decoder_step, translate_without_feedback, r"step \d+ of your greedy_translate writes token .* Each step's input is the previous step's argmax"),
])
def test_classic_decoder_bugs_get_specific_messages(decoder_step, greedy_translate, message):
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_attention_decoder(decoder_step, greedy_translate)


def test_the_decoder_check_passes_the_reference_and_a_step_that_calls_the_gru_cell():
    checks.check_attention_decoder(seq2seq.decoder_step, seq2seq.greedy_translate)
    checks.check_attention_decoder(decoder_step_with(), seq2seq.greedy_translate)  # the same step, written apart


def test_the_decoder_check_translates_strings_whose_greedy_choices_are_clear():
    """The translation part compares tokens exactly: on its six strings the course's model's best logit leads the
    second by far more than float32 rounding moves it, so a correct decoder in another order of operations passes."""
    from course_lib import assets
    from course_lib.data import reversal_batch

    model = assets.load("gru-reversal-attention")
    batch = reversal_batch(6, generator=torch.Generator().manual_seed(105))
    with torch.no_grad():
        enc_states, summary = model.encode(batch.src, batch.src_lengths)
        state, token, gaps = torch.tanh(model.bridge(summary)), torch.full((6,), BOS), []
        for _ in range(batch.tgt.shape[1]):
            logits, state, _ = model.decode_step(token, state, enc_states, summary, batch.src != PAD)
            top = logits.topk(2, dim=-1).values
            gaps.append(top[:, 0] - top[:, 1])
            token = logits.argmax(-1)
    assert torch.stack(gaps).min() > 1e-3

"""The toy task and the chapter 01 model."""
from __future__ import annotations

import pytest
import torch

import course_lib
from course_lib.data import EOS, PAD, digits_to_text, reversal_batch
from course_lib.seq2seq import GRUSeq2Seq, evaluate_reversal, seq2seq_loss


def test_reversal_targets_are_reversed_sources_then_eos(generator):
    batch = reversal_batch(50, min_len=2, max_len=9, generator=generator)
    for src, length, tgt in zip(batch.src, batch.src_lengths.tolist(), batch.tgt):
        text = digits_to_text(src)
        assert len(text) == length
        assert digits_to_text(tgt) == text[::-1]
        assert tgt[length] == EOS and (tgt[length + 1:] == PAD).all() and (src[length:] == PAD).all()
    assert batch.src_mask.sum(1).tolist() == batch.src_lengths.tolist()


@pytest.mark.parametrize("kwargs,match", [({"batch_size": 0}, "batch_size"), ({"batch_size": 4, "min_len": 0}, "min_len"),
                                          ({"batch_size": 4, "min_len": 5, "max_len": 3}, "max_len")])
def test_reversal_batch_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        reversal_batch(**kwargs)


@pytest.mark.parametrize("use_attention", [True, False])
def test_model_shapes_and_padding_invariance(use_attention, generator):
    torch.manual_seed(0)
    model = GRUSeq2Seq(use_attention=use_attention).eval()
    batch = reversal_batch(6, generator=generator)
    logits = model(batch)
    assert logits.shape == (*batch.tgt.shape, model.readout.out_features)
    assert torch.isfinite(seq2seq_loss(logits, batch.tgt))
    # Extra padding on the source must not change anything: the mask hides it from attention.
    padded = type(batch)(torch.cat([batch.src, torch.full((6, 3), PAD)], 1), batch.src_lengths, batch.tgt)
    torch.testing.assert_close(model(padded), logits, rtol=1e-5, atol=1e-5)


def test_loss_ignores_padding(generator):
    batch = reversal_batch(4, generator=generator)
    logits = torch.randn(*batch.tgt.shape, 13, generator=generator)
    real = batch.tgt != PAD
    expected = torch.nn.functional.cross_entropy(logits[real], batch.tgt[real])
    torch.testing.assert_close(seq2seq_loss(logits, batch.tgt), expected)


def test_evaluation_of_a_perfect_oracle_model():
    """exact match and alignment are 1.0 for a model that copies the right digit (built by hand)."""
    batch = reversal_batch(8, generator=torch.Generator().manual_seed(3))

    def oracle(model, src, src_lengths, max_len):  # a translator that copies the right digit, looking at it
        weights = torch.zeros(src.shape[0], max_len, src.shape[1])
        for row, n in enumerate(src_lengths.tolist()):
            for i in range(n):
                weights[row, i, n - 1 - i] = 1.0
        return batch.tgt.clone(), weights

    result = evaluate_reversal(GRUSeq2Seq(), batch, greedy_translate=oracle)
    assert result["exact"].all() and result["alignment"] == 1.0


def test_setup_notebook_rejects_zero_threads():
    with pytest.raises(ValueError, match="threads"):
        course_lib.setup_notebook(threads=0)


def test_decoder_step_is_the_models_step_in_float64(generator):
    """decoder_step (the GRU from its equations) against GRUSeq2Seq.decode_step (torch.nn.GRUCell), both in float64
    on a padded batch, with states far from 0 so that every gate matters."""
    import copy

    from course_lib.checks import randomize_parameters
    from course_lib.seq2seq import decoder_step

    model = randomize_parameters(GRUSeq2Seq(emb_dim=8, hidden=12), seed=5, scale=0.5).double().eval()
    batch = reversal_batch(4, generator=generator)
    with torch.no_grad():
        enc_states, summary = model.encode(batch.src, batch.src_lengths)
        state = torch.tanh(3 * torch.randn(4, 12, generator=generator, dtype=torch.float64))
        expected = copy.deepcopy(model).decode_step(batch.tgt[:, 0], state, enc_states, summary, batch.src_mask)
        actual = decoder_step(model, batch.tgt[:, 0], state, enc_states, batch.src_mask)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (actual[2][~batch.src_mask] == 0).all()


def test_greedy_translate_writes_the_trained_models_tokens():
    """On 1000 strings, with the shipped weights: the same tokens as GRUSeq2Seq.greedy_decode, weights to float32
    rounding; evaluate_reversal gives the same figures with either decoder."""
    from course_lib import assets
    from course_lib.seq2seq import greedy_translate

    model = assets.load("gru-reversal-attention")
    batch = reversal_batch(1000, generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        tokens, weights = greedy_translate(model, batch.src, batch.src_lengths, 11)
        expected_tokens, expected_weights = model.greedy_decode(batch.src, batch.src_lengths, 11)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-5)
    ours, theirs = evaluate_reversal(model, batch), evaluate_reversal(model, batch, greedy_translate=GRUSeq2Seq.greedy_decode)
    assert torch.equal(ours["exact"], theirs["exact"]) and ours["alignment"] == theirs["alignment"]


def test_evaluate_reversal_takes_the_learners_translator_by_the_name_of_the_course_function():
    """The plug-in rule (README): a keyword named greedy_translate, keyword-only, defaulting to the course's own
    greedy_translate, which it then calls for a model with attention (a model without attention: its greedy_decode)."""
    import inspect

    from course_lib import assets, seq2seq

    parameter = inspect.signature(evaluate_reversal).parameters["greedy_translate"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is seq2seq.greedy_translate
    batch = reversal_batch(3, generator=torch.Generator().manual_seed(5))
    calls = []

    def spy(model, src, src_lengths, max_len):
        calls.append(max_len)
        return seq2seq.greedy_translate(model, src, src_lengths, max_len)

    evaluate_reversal(assets.load("gru-reversal-attention"), batch, greedy_translate=spy)
    assert calls == [batch.tgt.shape[1]]
    evaluate_reversal(assets.load("gru-reversal-baseline"), batch, greedy_translate=spy)  # refused by greedy_translate
    assert calls == [batch.tgt.shape[1]]


def test_the_decoder_rejects_bad_arguments():
    from course_lib import assets
    from course_lib.seq2seq import decoder_step, greedy_translate

    batch = reversal_batch(2, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="max_len"):
        greedy_translate(assets.load("gru-reversal-attention"), batch.src, batch.src_lengths, 0)
    baseline = assets.load("gru-reversal-baseline")
    enc_states, summary = baseline.encode(batch.src, batch.src_lengths)
    with pytest.raises(ValueError, match="use_attention"):
        decoder_step(baseline, batch.tgt[:, 0], torch.tanh(baseline.bridge(summary)), enc_states, batch.src_mask)

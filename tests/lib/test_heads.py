"""course_lib.heads: the test layout, the scores, the losses, the attention-only model and the hand-built circuit."""
from __future__ import annotations

import math

import pytest
import torch

from course_lib import checks, heads
from course_lib.gpt import GPT, GPTConfig, attention_maps


def test_repeated_random_tokens_repeat_with_distinct_tokens_per_copy():
    tokens = heads.repeated_random_tokens(20, 8, 5, torch.Generator().manual_seed(0), copies=3)
    assert tokens.shape == (5, 24)
    assert torch.equal(tokens[:, :8], tokens[:, 8:16]) and torch.equal(tokens[:, :8], tokens[:, 16:])
    assert all(len(set(row[:8].tolist())) == 8 for row in tokens)
    assert heads.repeated_random_tokens(3, 10, 2).shape == (2, 20)  # more positions than tokens: with replacement
    with pytest.raises(ValueError):
        heads.repeated_random_tokens(0, 4, 1)


def test_first_token_score_by_a_loop():
    maps = checks.random_maps(2, 3, 4, 9, torch.Generator().manual_seed(1))
    want = torch.stack([maps[:, :, :, t, 0] for t in range(1, 9)]).mean(dim=(0, 2))
    torch.testing.assert_close(heads.first_token_score(maps), want)


def test_induction_score_equals_the_loop():
    maps = checks.random_maps(2, 2, 3, 12, torch.Generator().manual_seed(2))
    for period in (1, 4, 6, 11):
        torch.testing.assert_close(heads.induction_score(maps, period), checks.induction_oracle(maps, period), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("score", [heads.first_token_score, heads.previous_token_score, lambda maps: heads.induction_score(maps, 3)])
@pytest.mark.parametrize("shape", [(3, 4, 9, 9), (1, 3, 4, 9, 8), (2, 1, 3, 4, 9, 9)])
def test_head_scores_refuse_maps_that_are_not_five_dimensional_and_square(score, shape):
    with pytest.raises(ValueError, match=r"maps must be \(L, B, H, T, T\), got shape"):
        score(torch.rand(shape))


@pytest.mark.parametrize("argument,sizes", [("vocab_size", (0, 10, 8)), ("max_len", (5, -1, 8)), ("d_model", (5, 10, 0)),
                                            ("n_layer", (5, 10, 8, 0)), ("n_head", (5, 10, 8, 2, -2))])
def test_attention_only_refuses_sizes_below_one_naming_them(argument, sizes):
    with pytest.raises(ValueError, match=f"{argument} must be an integer >= 1"):
        heads.AttentionOnly(*sizes)


@pytest.mark.parametrize("vocab_size,max_len,argument", [(0, 10, "vocab_size"), (-3, 10, "vocab_size"), (8, 0, "max_len"),
                                                         (8, -4, "max_len")])
def test_the_circuit_refuses_sizes_below_one_naming_them(vocab_size, max_len, argument):
    with pytest.raises(ValueError, match=f"{argument} must be an integer >= 1"):
        heads.build_induction_model(vocab_size, max_len)


def test_the_circuit_holds_at_every_period_that_fits_its_vocabulary_and_length():
    model = heads.build_induction_model(16, 40)
    assert list(checks.induction_periods(16, 40)) == list(range(2, 17))
    for period in checks.induction_periods(16, 40):
        r = checks.induction_report(model, 16, period, batch=4, seed=period)
        assert r["induction"].item() > 0.99 and r["second"] < 0.01 and r["first"] > math.log(16), period


def test_copy_losses_against_cross_entropy_per_position():
    model = checks.random_attention_only(3, V=11, max_len=16)
    tokens = heads.repeated_random_tokens(11, 8, 3, torch.Generator().manual_seed(3))
    logits = model(tokens)[0]
    nll = [-torch.log_softmax(logits[:, t], -1).gather(1, tokens[:, t + 1:t + 2]).mean().item() for t in range(15)]
    first, second = heads.copy_losses(model, tokens, 8)
    assert math.isclose(first, sum(nll[:7]) / 7, rel_tol=1e-9) and math.isclose(second, sum(nll[8:]) / 7, rel_tol=1e-9)


def test_attention_only_is_computed_as_gpt_names_it():
    """attention_maps (which recomputes each head's weights from c_attn) sees the weights the forward pass used."""
    model = checks.random_attention_only(4)
    idx = torch.randint(11, (2, 10), generator=torch.Generator().manual_seed(4))
    maps = attention_maps(model, idx)
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(10))
    attn = model.transformer.h[0].attn
    q, k, v = attn.c_attn(x).split(12, dim=2)
    q, k, v = (t.view(2, 10, 3, 4).transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-2, -1) / 2).masked_fill(~torch.ones(10, 10, dtype=torch.bool).tril(), -math.inf)
    torch.testing.assert_close(maps[0], torch.softmax(s, -1))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("V,period", [(8, 8), (30, 20), (103, 64)])
def test_the_circuit_copies_in_context(V, period):
    report = checks.induction_report(heads.build_induction_model(V, 2 * period), V, period, batch=4)
    assert report["previous"].item() > 0.99 and report["induction"].item() > 0.99
    assert report["second"] < 0.01 and report["first"] > math.log(V)


def test_ablating_a_gpt_head_equals_zeroing_its_columns():
    torch.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=9, block_size=8, n_layer=2, n_head=2, n_embd=8, dropout=0.0, bias=True)).double().eval()
    idx = torch.randint(9, (1, 8))
    before = model(idx)[0]
    with heads.ablate_head(model, 1, 1):
        torch.testing.assert_close(model(idx)[0], checks.head_zeroed_copy(model, 1, 1)(idx)[0])
    assert torch.equal(model(idx)[0], before)
    with pytest.raises(ValueError), heads.ablate_head(model, 0, 2):
        pass


# ----------------------------------------------------------------------------- the trained pair's data (course pretrain)


def repeat_of(row: list[int]) -> tuple[int, int] | None:
    """Written apart from the generator: the (offset, period) of the longest stretch of row that, from some
    offset o, is a segment of period p repeated to the end (at least two whole copies), with distinct tokens in
    the segment; None if there is none. The smallest offset wins (the generator's prefix may extend the stretch)."""
    T = len(row)
    for o in range(T):
        for p in range(1, (T - o) // 2 + 1):
            if len(set(row[o:o + p])) == p and all(row[t] == row[t - p] for t in range(o + p, T)):
                return o, p
    return None


def test_the_training_batch_repeats_a_segment_at_random_periods_and_offsets():
    periods = [3, 5, 8, 16]
    tokens = heads.induction_training_batch(16, 32, 400, periods, torch.Generator().manual_seed(0))
    assert tokens.shape == (400, 32) and tokens.dtype == torch.int64 and 0 <= int(tokens.min()) and int(tokens.max()) < 16
    found = [repeat_of(row) for row in tokens.tolist()]
    assert all(f is not None for f in found)
    # the period found is the one drawn (prefix tokens that coincide with the segment's last ones move the offset
    # back, never change the period): every period is drawn, at offsets spread over their whole range
    assert {p for _, p in found} == set(periods)
    for p in periods:
        offsets = {o for o, q in found if q == p}
        assert min(offsets) == 0 and max(offsets) >= 32 - 2 * p - 1 and (p == 16 or len(offsets) >= min(5, 32 - 2 * p))
    # the same generator seed, the same batch
    again = heads.induction_training_batch(16, 32, 400, periods, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, again)


def test_the_training_batch_rejects_periods_that_do_not_fit_twice():
    with pytest.raises(ValueError):
        heads.induction_training_batch(16, 32, 4, [17])
    with pytest.raises(ValueError):
        heads.induction_training_batch(16, 32, 4, [])


def test_training_never_draws_a_held_out_period():
    from course_lib.pretrain import RECIPES

    for name in ("induction-2l", "induction-1l"):
        recipe = RECIPES[name]
        trained, held_out = set(recipe.train_args["periods"]), set(recipe.evaluate["held_out_periods"])
        assert held_out and not trained & held_out
        # every training row's period (recovered from the rows of the recipe's first steps) is a trained one
        generator = torch.Generator().manual_seed(recipe.train_args["seed"])
        for _ in range(5):
            batch = heads.induction_training_batch(16, 32, recipe.train_args["batch_size"], recipe.train_args["periods"], generator)
            assert {repeat_of(row)[1] for row in batch.tolist()} <= trained
    with pytest.raises(ValueError, match="held-out"):
        heads.train_induction(heads.AttentionOnly(8, 16, 8), steps=1, batch_size=2, lr=1e-3, init_std=0.1, seed=0,
                              periods=[3, 4], held_out_periods=[4], eval_batch=2, eval_seed=0, progress=False)


def test_previous_token_score_of_ideal_and_uniform_heads():
    T = 6
    ideal = torch.zeros(T, T)
    ideal[0, 0] = 1
    ideal[torch.arange(1, T), torch.arange(T - 1)] = 1
    uniform = torch.ones(T, T).tril() / torch.arange(1, T + 1)[:, None]
    maps = torch.stack([ideal, uniform]).view(1, 1, 2, T, T)  # one layer, one batch element, two heads
    scores = heads.previous_token_score(maps)
    assert scores.shape == (1, 2)
    assert scores[0, 0].item() == 1.0
    assert abs(scores[0, 1].item() - sum(1 / t for t in range(2, T + 1)) / (T - 1)) < 1e-6


def test_recording_scores_during_training_leaves_the_training_as_it_was():
    def trained(score_every):
        torch.manual_seed(0)
        model = heads.AttentionOnly(8, 16, 16, n_layer=2, n_head=2)
        record = heads.train_induction(model, steps=20, batch_size=4, lr=3e-3, init_std=0.1, seed=1, periods=[2, 3, 5],
                                       held_out_periods=[4], eval_batch=8, eval_seed=7, progress=False,
                                       score_every=score_every)
        return model, record
    (often, every_5), (rarely, _) = trained(5), trained(1000)
    assert all(torch.equal(a, b) for a, b in zip(often.state_dict().values(), rarely.state_dict().values()))
    during = every_5["during_training"]
    assert during["steps"] == [0, 5, 10, 15, 20] and during["period"] == 4
    tokens = heads.repeated_random_tokens(8, 4, 8, torch.Generator().manual_seed(7))
    with torch.no_grad():
        maps = attention_maps(often, tokens)
    assert during["induction"][-1] == round(heads.induction_score(maps, 4)[-1].max().item(), 4)


def test_the_shipped_scores_during_training_end_at_the_finished_models_scores():
    from course_lib import assets

    for name in ("induction-2l", "induction-1l"):
        record = assets.info(name)
        during, held_out = record["during_training"], record["held_out"]
        assert during["steps"] == list(range(0, record["train"]["steps"] + 1, 50))
        final = held_out["by_period"][str(during["period"])]
        assert (during["batch"], during["seed"]) == (held_out["batch"], held_out["seed"])
        assert during["induction"][-1] == pytest.approx(max(final["induction"][-1]), abs=2e-4)

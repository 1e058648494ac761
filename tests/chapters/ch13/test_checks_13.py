"""Chapter 13's learner-facing checks: the reference passes; each classic mistake gets a specific message."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from course_lib import checks, heads
from course_lib.heads import AttentionOnly
from tests.helpers import mutant


def variant(function, *replacements):
    """The reference `function` with each (old, new) replacement applied to its source."""
    namespace = {"torch": torch, "math": math, "nn": nn, "contextlib": contextlib, "AttentionOnly": AttentionOnly}
    return mutant(function, *replacements, namespace=namespace)


def test_reference_implementations_pass_every_visible_check(capsys):
    checks.check_induction_score(heads.induction_score)
    checks.check_build_induction_model(heads.build_induction_model)
    checks.check_ablate_head(heads.ablate_head)
    assert capsys.readouterr().out.count("all visible checks passed") == 3


BUILD = heads.build_induction_model
L1_KEY = "W[C + 1:C + P, POS:POS + P - 1] = eye_p[:P - 1, :P - 1]"
L2_KEY = "W[C:C + V, PREV:PREV + V] = eye_v"


def weights_edited_without_restoring(model, layer, head):
    attn = model.transformer.h[layer].attn
    size = attn.c_proj.in_features // attn.n_head
    with torch.no_grad():
        attn.c_proj.weight[:, head * size:(head + 1) * size] = 0.0
    return contextlib.nullcontext(model)


def output_rows(model, layer, head):
    attn = model.transformer.h[layer].attn
    size = attn.c_proj.in_features // attn.n_head

    @contextlib.contextmanager
    def ablated():
        saved = attn.c_proj.weight.detach().clone()
        with torch.no_grad():
            attn.c_proj.weight[head * size:(head + 1) * size, :] = 0.0
        try:
            yield model
        finally:
            with torch.no_grad():
                attn.c_proj.weight.copy_(saved)
    return ablated()


@pytest.mark.parametrize("check,buggy,message", [
    (checks.check_induction_score, variant(heads.induction_score, ("keys = queries - period + 1", "keys = queries - period")),
     "the earlier occurrence of the query's own token"),
    (checks.check_induction_score, variant(heads.induction_score, ("keys = queries - period + 1", "keys = queries - period + 2")),
     "one past the token after"),
    (checks.check_induction_score, lambda maps, period: checks.induction_oracle(maps, period, first=period - 1),
     "the queries of the first copy too"),
    (checks.check_induction_score, variant(heads.induction_score, ("maps[..., queries, keys].double()", "maps[..., queries, keys]")),
     "the docstring asks for float64"),
    (checks.check_induction_score, variant(heads.induction_score, ("if not 1 <= period < T:", "if False:")), "expected ValueError"),
    (checks.check_induction_score, variant(heads.induction_score, ("if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2]:", "if False:")),
     r"maps of shape \(3, 4, 10, 10\) \(one layer's maps, no layer dimension\): expected a ValueError naming maps .*got IndexError"),
    (checks.check_build_induction_model, variant(BUILD, (L1_KEY, "W[C:C + P, POS:POS + P] = eye_p")), "attends to the current token"),
    (checks.check_build_induction_model, variant(BUILD, (L2_KEY, "W[C:C + V, TOK:TOK + V] = eye_v")), "copies A instead of B"),
    (checks.check_build_induction_model, variant(BUILD, ("hard = 30.0 * math.sqrt(C)", "hard = 1.0")), "the attention is diffuse"),
    (checks.check_build_induction_model, variant(BUILD, ("hard = 30.0 * math.sqrt(C)", "hard = 30.0 * math.sqrt(C)\n    hard2 = 1.0"),
                                                 ("W[0:V, TOK:TOK + V] = hard * eye_v", "W[0:V, TOK:TOK + V] = hard2 * eye_v")),
     "layer 2's head .* the attention is diffuse"),
    (checks.check_build_induction_model, variant(BUILD, ("model.lm_head.weight[:, OUT:OUT + V]", "model.lm_head.weight[:, TOK:TOK + V]")),
     "silencing layer 2 does not change the logits: its output does not reach them"),
    (checks.check_ablate_head, variant(heads.ablate_head, ("    try:\n        yield model\n    finally:  # restore, even if the block raised\n        handle.remove()",
                                                           "    yield model\n    handle.remove()")), "in a `finally:`"),
    (checks.check_ablate_head, variant(heads.ablate_head, ("y[..., head * size:(head + 1) * size] = 0.0", "y[..., head:head + size] = 0.0")),
     "silenced head|differ"),
    (checks.check_ablate_head, variant(heads.ablate_head, ("y[..., head * size:(head + 1) * size] = 0.0",
                                                           "y[..., ((head + 1) % 3) * size:((head + 1) % 3 + 1) * size] = 0.0")),
     "silenced head"),
    (checks.check_ablate_head, variant(heads.ablate_head, ("        handle.remove()", "        pass")),
     "still differs from before"),
    (checks.check_ablate_head, weights_edited_without_restoring, "still differs from before"),
    (checks.check_ablate_head, output_rows, "output"),
    (checks.check_ablate_head, lambda model, layer, head: contextlib.nullcontext(model), "nothing was silenced"),
    (checks.check_ablate_head, variant(heads.ablate_head, ("if not 0 <= layer < len(blocks):", "if False:")),
     "expected ValueError, got IndexError"),
])
def test_each_classic_mistake_gets_its_message(check, buggy, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check(buggy)


def test_position_zero_unguarded_fails_at_short_periods_and_is_named():
    """Without hint 3's guard the circuit passes at period 12 (the old check's only period) and fails at period 2."""
    unguarded = variant(BUILD, ("W[C + V, POS] = -1.0", "pass"))
    report = checks.induction_report(unguarded(12, 30), 12, 12)
    assert report["induction"].item() > 0.9 and report["second"] < 0.1  # what the old check measured: a pass
    with pytest.raises(checks.CheckFailed, match=r"at period \d, .* puts 0\.500 on position 0: position 0 has no previous token"):
        checks.check_build_induction_model(unguarded)


def test_a_query_scale_of_30_is_named_not_called_a_wrong_match():
    with pytest.raises(checks.CheckFailed, match=r"the match wins, but not by enough\. .*a query scale of 30 gives a match only 3\.7"):
        checks.check_build_induction_model(variant(BUILD, ("hard = 30.0 * math.sqrt(C)", "hard = 30.0")))


def test_a_value_that_copies_a_is_named_not_called_a_missing_output():
    copies_a = variant(BUILD, ("W[2 * C:2 * C + V, TOK:TOK + V] = eye_v  # v[j] = the token at j\n        attn.c_proj.weight[OUT",
                               "W[2 * C:2 * C + V, PREV:PREV + V] = eye_v\n        attn.c_proj.weight[OUT"))
    with pytest.raises(checks.CheckFailed, match=r"predicts the current token A again .* it must read that position's own token, B"):
        checks.check_build_induction_model(copies_a)


@pytest.mark.parametrize("replacement,message", [
    (("hard = 30.0 * math.sqrt(C)", "hard = 6.0 * math.sqrt(C)"), r"vocabulary 103, max_len 128: at period 64, layer 1's .*not by enough"),
    (("model.lm_head.weight[:, OUT:OUT + V] = 10.0 * eye_v", "model.lm_head.weight[:, OUT:OUT + V] = 6.0 * eye_v"),
     r"vocabulary 103, max_len 128: at period 64, the loss on the second copy is 0\.2"),
])
def test_a_circuit_that_holds_for_12_tokens_but_not_for_section_3s_103_is_caught(replacement, message):
    """A query scale of 6 sqrt(d_model) or an lm_head weight of 6 passes every period at vocabulary 12 (the check's only
    case before) and fails section 3's table (vocabulary 103, max_len 128, periods 37 and 64) with a bare assertion."""
    short = variant(BUILD, replacement)
    model = short(12, 30)
    for period in checks.induction_periods(12, 30):  # the contract's criteria, as the check's first case measures them
        r = checks.induction_report(model, 12, period)
        assert r["previous"].max() > 0.9 and r["induction"].max() > 0.9 and r["second"] < 0.1 and r["first"] > r["ln V"] / 2
    with pytest.raises(checks.CheckFailed, match=message):
        checks.check_build_induction_model(short)

"""Chapter 04's grading round trip through nbgrader, with real submission notebooks.

One `grading.grade` run grades four students: the reference (full marks), the untouched release
(zero) and two students with three planted bugs each, one per exercise, chosen so that the tests
each bug must fail are disjoint. The expected failures follow from what each test cell documents
(its first comment line); tests/chapters/ch04/test_hidden_04.py runs the same cells against many more bugs, one
at a time and without nbgrader. The GPT of exercise 2 builds its blocks' attention as CausalSelfAttention(config),
which the clean room makes the reference attention, so a bug in exercise 1 cannot cost points in exercise 2.
"""
from __future__ import annotations

import pytest

from tests import roundtrip
from tests.helpers import failing
from tests.roundtrip import Chapter, round_trip

CH = Chapter("04-gpt", "gpt")
ATT, GPT, CNT = "causal_self_attention-solution", "gpt-solution", "gpt_param_count-solution"
MASKED = "masked_softmax(q @ k.transpose(-2, -1) / math.sqrt(C // self.n_head), causal)"
LOSS = "F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T), ignore_index=-100)"
TIE = "self.lm_head.weight = self.transformer.wte.weight"


def planted_a() -> dict:
    return CH.solved({
        # the causal mask is built but not applied: the future leaks -> visible, future and heads (one token is unaffected)
        ATT: CH.mutate(ATT, MASKED, MASKED.replace(", causal)", ")")),
        # the mean includes the -100 padding positions -> loss only (the other tests have no padding)
        GPT: CH.mutate(GPT, LOSS, LOSS[:-1] + ', reduction="none").mean()'),
        # config.bias ignored: biases always counted -> bias, and the visible check (it counts a bias=False config)
        CNT: CH.mutate(CNT, "b = 1 if config.bias else 0", "b = 1"),
    })


def planted_b() -> dict:
    return CH.solved({
        # tril(-1): the diagonal is left out, token 0 attends to nothing -> visible, self and heads (nothing leaks)
        ATT: CH.mutate(ATT, ".tril()", ".tril(-1)"),
        # re-assignment order: the head is re-created after the tie, so it is a separate matrix -> visible and tying
        GPT: CH.mutate(GPT, TIE, TIE + "\n        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)"),
        # the tied head counted anyway -> visible, gpt2 and untied (the bias difference is unaffected)
        CNT: CH.mutate(CNT, "head = 0 if tied else V * C", "head = V * C"),
    })



# student -> (notebook, the tests that must fail)
STUDENTS = {
    "reference": (CH.solved, set()),
    "untouched": (CH.untouched, set(CH.points)),
    "planted_a": (planted_a, failing("causal_self_attention", "visible", "future", "heads") | failing("gpt", "loss")
                  | failing("gpt_param_count", "visible", "bias")),
    "planted_b": (planted_b, failing("causal_self_attention", "visible", "self", "heads") | failing("gpt", "visible", "tying")
                  | failing("gpt_param_count", "visible", "gpt2", "untied")),
}


graded, test_each_student_loses_exactly_its_bugs_points, test_reference_untouched_and_submissions = round_trip(
    CH, STUDENTS, total=20)  # one nbgrader run grades every student


@pytest.mark.slow
def test_failures_carry_the_checks_messages(graded):
    messages = roundtrip.messages(graded, CH, "planted_a")
    assert "must not see positions after t" in messages["causal_self_attention-visible"]
    assert "padding (-100)" in messages["gpt-loss"]
    messages = roundtrip.messages(graded, CH, "planted_b")
    assert "leave out the diagonal" in messages["causal_self_attention-visible"]
    assert "is not model.transformer.wte.weight" in messages["gpt-visible"]

"""Chapter 07's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with
ONE planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top
of each cell), and correct alternative implementations must pass everything. The loop's tests pass the
course's acceptance rule (checks.speculative_accept_oracle) as ``speculative_accept``, so a bug in exercise 1
never costs points in exercise 2. tests/chapters/ch07/test_grading_07.py checks the same on whole notebooks through nbgrader.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.gpt import GPT, GPTConfig, gpt_sample
from course_lib.kv_cache import KVCache, cached_forward
from course_lib.speculative import SpeculativeOutput, check_speculative_arguments, draw_token, probs_from_logits
from tests.cell_harness import TestCells
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks

SOURCE = ROOT / "solutions" / "07-speculative" / "speculative.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "checks": checks, "GPT": GPT, "GPTConfig": GPTConfig,
                             "gpt_sample": gpt_sample, "KVCache": KVCache, "cached_forward": cached_forward,
                             "draw_token": draw_token, "probs_from_logits": probs_from_logits,
                             "SpeculativeOutput": SpeculativeOutput, "check_speculative_arguments": check_speculative_arguments})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

ACC, GEN = "speculative_accept", "speculative_generate"
RATIO = "if u[i] >= p[i, x] / q[i, x]:"
RESIDUAL = "residual = (p[i] - q[i]).clamp(min=0)"
CROP_T, CROP_D = "target_cache.crop(n + a)", "draft_cache.crop(min(draft_cache.length, n + a))"
P_ROWS = "p = probs_from_logits(logits[0, -(K + 1):], do_sample, temperature)"
APPEND = "tokens = torch.cat([tokens, drafts[:, :a], draw_token(next_probs, generator)], dim=1)"

CASES = [
    # the acceptance / residual step
    (ACC, "residual not renormalised", mutate(ACC, ("return i, residual / residual.sum()", "return i, residual")),
     {f"{ACC}-visible", f"{ACC}-residual"}),
    (ACC, "p and q swapped everywhere", mutate(ACC, (RATIO, "if u[i] >= q[i, x] / p[i, x]:"), (RESIDUAL, "residual = (q[i] - p[i]).clamp(min=0)")),
     {f"{ACC}-visible", f"{ACC}-swapped", f"{ACC}-residual"}),  # the residual of q - p is not the residual
    (ACC, "p and q swapped in the ratio", mutate(ACC, (RATIO, "if u[i] >= q[i, x] / p[i, x]:")), {f"{ACC}-visible", f"{ACC}-swapped"}),
    (ACC, "p and q swapped in the residual", mutate(ACC, (RESIDUAL, "residual = (q[i] - p[i]).clamp(min=0)")),
     {f"{ACC}-visible", f"{ACC}-residual"}),
    (ACC, "bonus missing: nothing after all K accepted", mutate(ACC, ("return K, p[K]", "return K, None")),
     {f"{ACC}-visible", f"{ACC}-bonus"}),
    (ACC, "bonus from the last draft position", mutate(ACC, ("return K, p[K]", "return K, p[K - 1]")),
     {f"{ACC}-visible", f"{ACC}-bonus"}),
    (ACC, "correct: vectorised", '''
def speculative_accept(p, q, draft_tokens, u):
    K = len(draft_tokens)
    ok = u < p[torch.arange(K), draft_tokens] / q[torch.arange(K), draft_tokens]
    n = int(torch.cumprod(ok.long(), 0).sum())
    if n == K:
        return K, p[K]
    r = torch.relu(p[n] - q[n])
    return n, r / r.sum()
''', set()),
    (ACC, "correct: u * q < p, no division", mutate(ACC, (RATIO, "if not u[i] * q[i, x] < p[i, x]:")), set()),
    # the whole loop (argmax draws, the temperature, K = 0: tests/chapters/ch07/test_checks_07.py names them)
    (GEN, "no rollback", mutate(GEN, (CROP_T, "pass"), (CROP_D, "pass")),
     {f"{GEN}-visible", f"{GEN}-greedy", f"{GEN}-rounds", f"{GEN}-distribution"}),  # the stale caches soon crash
    (GEN, "bonus token dropped", mutate(GEN, (APPEND, "tokens = torch.cat([tokens, drafts[:, :a]] + ([draw_token(next_probs, generator)] if a < K else []), dim=1)")),
     {f"{GEN}-visible", f"{GEN}-bonus", f"{GEN}-greedy", f"{GEN}-rounds", f"{GEN}-distribution"}),  # caches one ahead
    (GEN, "bonus token added after a rejection too", mutate(GEN, (APPEND, APPEND + "\n        if a < K:\n            tokens = torch.cat([tokens, draw_token(p[K], generator)], dim=1)")),
     {f"{GEN}-visible", f"{GEN}-greedy", f"{GEN}-rounds"}),  # too small a change of x2 for 400 runs to see
    (GEN, "p one position early", mutate(GEN, (P_ROWS, "p = probs_from_logits(logits[0, -(K + 2):-1], do_sample, temperature)")),
     {f"{GEN}-visible", f"{GEN}-bonus", f"{GEN}-greedy", f"{GEN}-rounds", f"{GEN}-distribution"}),
    (GEN, "one proposal too many near the end", mutate(GEN, ("K = min(num_draft_tokens, total - n - 1)", "K = min(num_draft_tokens, total - n)")),
     {f"{GEN}-visible", f"{GEN}-greedy", f"{GEN}-rounds"}),  # overshoots max_new_tokens
    (GEN, "next token drawn from the target's p instead of next_probs", mutate(GEN, ("draw_token(next_probs, generator)", "draw_token(p[a], generator)")),
     {f"{GEN}-visible", f"{GEN}-distribution"}),  # greedy, the residual of two one-hots is the target's one-hot
    (GEN, "caches cropped one slot too far", mutate(GEN, (CROP_T, "target_cache.crop(n + a - 1)"), (CROP_D, "draft_cache.crop(min(draft_cache.length, n + a - 1))")),
     {f"{GEN}-visible", f"{GEN}-rounds"}),  # re-feeding a token is wasteful, not wrong: the tokens stay right
    (GEN, "correct: a separate catch-up pass for the draft", mutate(GEN, (
        "new, drafted, q = tokens[:, draft_cache.length:], [], []",
        "new, drafted, q = tokens[:, draft_cache.length:], [], []\n        if K and new.shape[1] > 1:\n"
        "            cached_forward(draft, new[:, :-1], draft_cache)\n            new = new[:, -1:]")), set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {ACC, GEN}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == 4 + (exercise == GEN)


@pytest.mark.parametrize("exercise", [ACC, GEN])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


def test_a_bug_in_exercise_1_costs_nothing_in_exercise_2():
    HARNESS.reference = {**REFERENCE, ACC: mutate(ACC, (RATIO, "if u[i] >= q[i, x] / p[i, x]:"))}
    try:
        assert failing_tests(GEN, REFERENCE[GEN]) == set()
    finally:
        HARNESS.reference = REFERENCE

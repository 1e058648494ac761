"""Chapter 07's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with
ONE planted bug. Every bug must fail exactly the tests documented to target it (the comment at the top
of each cell), and correct alternative implementations must pass everything. The step's tests pass the
course's acceptance rule (checks.speculative_accept_oracle) as ``accept``, so a bug in exercise 1 never
costs points in exercise 2. tests/chapters/ch07/test_grading_07.py checks the same on whole notebooks through nbgrader.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from course_lib.gpt import GPT, GPTConfig, gpt_sample
from course_lib.kv_cache import KVCache, cached_forward
from course_lib.speculative import draw_token, probs_from_logits
from tests.cell_harness import TestCells
from tests.helpers import ROOT

pytestmark = pytest.mark.usefixtures("one_thread")  # as in the notebooks

SOURCE = ROOT / "solutions" / "07-speculative" / "speculative.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "checks": checks, "GPT": GPT, "GPTConfig": GPTConfig,
                             "gpt_sample": gpt_sample, "KVCache": KVCache, "cached_forward": cached_forward,
                             "draw_token": draw_token, "probs_from_logits": probs_from_logits})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

ACC, STEP = "speculative_accept", "speculative_step"
RATIO = "if u[i] >= p[i, x] / q[i, x]:"
RESIDUAL = "residual = (p[i] - q[i]).clamp(min=0)"
CROP_T, CROP_D = "target_cache.crop(n + a)", "draft_cache.crop(min(draft_cache.length, n + a))"
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
    # the full step
    (STEP, "cache not rolled back", mutate(STEP, (CROP_T, "pass"), (CROP_D, "pass")),
     {f"{STEP}-visible", f"{STEP}-rollback", f"{STEP}-greedy"}),
    (STEP, "only the target cache rolled back", mutate(STEP, (CROP_D, "pass")),
     {f"{STEP}-visible", f"{STEP}-rollback", f"{STEP}-greedy"}),
    (STEP, "caches rolled back one slot too far", mutate(STEP, (CROP_T, "target_cache.crop(n + a - 1)"),
                                                       (CROP_D, "draft_cache.crop(min(draft_cache.length, n + a - 1))")),
     {f"{STEP}-visible", f"{STEP}-rollback"}),  # re-feeding a token is wasteful, not wrong: the tokens stay right
    (STEP, "bonus token missing", mutate(STEP, (APPEND, "tokens = torch.cat([tokens, drafts[:, :a]] + ([draw_token(next_probs, generator)] if a < K else []), dim=1)"),
                                          (CROP_T, "target_cache.crop(min(n + a, tokens.shape[1] - 1))"),
                                          (CROP_D, "draft_cache.crop(min(draft_cache.length, tokens.shape[1] - 1))")),
     {f"{STEP}-visible", f"{STEP}-bonus", f"{STEP}-rollback"}),  # at K = 0 (a = K) it adds no token at all
    (STEP, "K = 0 not handled: torch.stack of no drafts", mutate(STEP, (
        "accept(p, torch.stack(q) if K else p[:0], drafts[0], u)", "accept(p, torch.stack(q), drafts[0], u)")),
     {f"{STEP}-visible", f"{STEP}-rollback"}),  # the visible check and the rollback test run K = 0 rounds
    (STEP, "correct: drafts fed one at a time after a separate catch-up", mutate(STEP, (
        "new, drafted, q = tokens[:, draft_cache.length:], [], []",
        "new, drafted, q = tokens[:, draft_cache.length:], [], []\n    if new.shape[1] > 1:\n"
        "        cached_forward(draft, new[:, :-1], draft_cache)\n        new = new[:, -1:]")), set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {ACC, STEP}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == 4


@pytest.mark.parametrize("exercise", [ACC, STEP])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


def test_a_bug_in_exercise_1_costs_nothing_in_exercise_2():
    HARNESS.reference = {**REFERENCE, ACC: mutate(ACC, (RATIO, "if u[i] >= q[i, x] / p[i, x]:"))}
    try:
        assert failing_tests(STEP, REFERENCE[STEP]) == set()
    finally:
        HARNESS.reference = REFERENCE

"""Chapter 12's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it, and correct alternatives must
pass everything. Oracles: slots from the definition, contiguous attention in float64
(checks.contiguous_attention), hand-made sequences whose scheduling the policy of the
chapter's section 3 decides.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from course_lib import checks
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "12-serving" / "serving.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "F": F, "math": math, "checks": checks})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

SLOTS, ATTN, SCHED = "slot_mapping", "paged_attention", "schedule_step"
RETURN = "return block * block_size + offset"
VALID = "valid = torch.arange(M * S, device=q.device)[None, :] < context_lens[:, None]"
SCALED = "attn_mask=valid[:, None, None, :])"

CASES = [
    (SLOTS, "the positions themselves", mutate(SLOTS, (RETURN, "return positions")),
     {f"{SLOTS}-visible", f"{SLOTS}-scattered", f"{SLOTS}-edges"}),
    (SLOTS, "block + offset", mutate(SLOTS, (RETURN, "return block + offset")),
     {f"{SLOTS}-visible", f"{SLOTS}-scattered", f"{SLOTS}-edges"}),
    (SLOTS, "correct: a loop over positions", '''
def slot_mapping(block_table, positions, block_size):
    return torch.tensor([int(block_table[p // block_size]) * block_size + p % block_size for p in positions.tolist()],
                        dtype=torch.long)
''', set()),
    (ATTN, "no mask: whole blocks attended", mutate(ATTN, (VALID, "valid = torch.ones(B, M * S, dtype=torch.bool)")),
     {f"{ATTN}-visible", f"{ATTN}-partial", f"{ATTN}-batch"}),
    (ATTN, "not scaled", mutate(ATTN, (SCALED, "attn_mask=valid[:, None, None, :], scale=1.0)")),
     {f"{ATTN}-visible", f"{ATTN}-partial", f"{ATTN}-batch"}),
    (ATTN, "off by one: the newest token left out", mutate(ATTN, (VALID, VALID.replace("< context_lens", "< context_lens - 1 + (context_lens == 1).long()"))),
     {f"{ATTN}-visible", f"{ATTN}-partial", f"{ATTN}-batch"}),
    (ATTN, "correct: F.scaled_dot_product_attention per sequence", '''
def paged_attention(q, key_pool, value_pool, block_tables, context_lens):
    import torch.nn.functional as F
    out = []
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        keys = key_pool[block_tables[b]].flatten(0, 1)[:n].transpose(0, 1)
        values = value_pool[block_tables[b]].flatten(0, 1)[:n].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[b][:, None], keys, values)[:, 0])
    return torch.stack(out)
''', set()),
    (SCHED, "admits after a preemption", mutate(SCHED, ("    if not preempted:\n", "    if True:\n")),
     {f"{SCHED}-visible", f"{SCHED}-preempt"}),
    (SCHED, "preempts the oldest", mutate(SCHED, ("victim = candidates.pop()", "victim = candidates.pop(0)")),
     {f"{SCHED}-visible", f"{SCHED}-preempt"}),
    (SCHED, "waiting requests overtake", mutate(SCHED, ("            if need > free:\n                break\n",
                                                        "            if need > free:\n                continue\n")),
     {f"{SCHED}-visible"}),
    (SCHED, "no chunked prefill: the budget ignored", mutate(SCHED, ("n = min(seq.n_tokens - seq.n_cached, budget)\n        need",
                                                                     "n = seq.n_tokens - seq.n_cached\n        need"),
                                                            ("            n = min(seq.n_tokens - seq.n_cached, budget)",
                                                             "            n = seq.n_tokens - seq.n_cached")),
     {f"{SCHED}-visible", f"{SCHED}-budget"}),
    (SCHED, "decodes before an older request's prompt chunk", mutate(SCHED, ("candidates = list(running)",
                                                                            "candidates = sorted(running, key=lambda s: s.n_tokens - s.n_cached > 1)")),
     {f"{SCHED}-visible", f"{SCHED}-budget"}),
    (SCHED, "a waiting sequence's n_cached ignored", mutate(SCHED, ("            n = min(seq.n_tokens - seq.n_cached, budget)",
                                                                   "            n = min(seq.n_tokens, budget)")),
     {f"{SCHED}-visible", f"{SCHED}-budget"}),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {SLOTS, ATTN, SCHED}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) == 3


@pytest.mark.parametrize("exercise", [SLOTS, ATTN, SCHED])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


@pytest.mark.parametrize("cell,bug,says", [
    (f"{SCHED}-preempt", mutate(SCHED, ("victim = candidates.pop()", "victim = candidates.pop(0)")),
     "d, the most recent, is preempted"),
    (f"{SCHED}-budget", mutate(SCHED, ("candidates = list(running)",
                                       "candidates = sorted(running, key=lambda s: s.n_tokens - s.n_cached > 1)")),
     "a (the older, 18 prompt tokens to go) then b"),
])
def test_the_scheduler_tests_explain_a_failure_in_words(cell, bug, says):
    """A failed hidden test names the sequences and says what was expected and why, never a raw namespace dump."""
    message = HARNESS.failure_message(cell, bug)
    assert says in message and "expected" in message
    assert "namespace(" not in message and "lambda" not in message

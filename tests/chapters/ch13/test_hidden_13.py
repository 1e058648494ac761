"""Chapter 13's test cells, run directly (no nbgrader) against the classic mistakes, one planted bug at a time.

Each exercise's visible and hidden test cells run in a namespace holding the reference solutions with ONE
planted bug. Every bug must fail exactly the tests documented to target it, and correct alternatives must
pass everything. Oracles: the induction score by a float64 loop (checks.induction_oracle), the circuit by its
behaviour (checks.induction_report), an ablated head by a copy with its c_proj columns zeroed.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch import nn

from course_lib import checks, heads
from course_lib.gpt import attention_maps
from course_lib.heads import AttentionOnly
from tests.cell_harness import TestCells
from tests.helpers import ROOT, failing

SOURCE = ROOT / "solutions" / "13-heads" / "heads.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "nn": nn, "contextlib": contextlib, "checks": checks,
                             "heads": heads, "attention_maps": attention_maps, "AttentionOnly": AttentionOnly})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

IS, BIM, AH = "induction_score", "build_induction_model", "ablate_head"

CASES = [
    (IS, "key t - period (duplicate token)", mutate(IS, ("keys = queries - period + 1", "keys = queries - period")),
     failing(IS, "visible", "copies", "model")),
    (IS, "no float64", mutate(IS, ("maps[..., queries, keys].double()", "maps[..., queries, keys]")),
     failing(IS, "visible", "model")),  # copies: its maps are float64 already
    (IS, "no check of the maps' shape", mutate(IS, ("if maps.dim() != 5 or maps.shape[-1] != maps.shape[-2]:", "if False:")),
     failing(IS, "visible")),  # one layer's maps (B, H, T, T) give an IndexError, not a ValueError naming maps
    (IS, "correct: a loop over the queries", '''
def induction_score(maps, period):
    if maps.ndim != 5:
        raise ValueError("maps must be (L, B, H, T, T)")
    T = maps.shape[-1]
    if period < 1 or period >= T:
        raise ValueError("period")
    total = 0
    for t in range(period, T):
        total = total + maps[..., t, t - period + 1].double().mean(1)
    return total / (T - period)
''', set()),
    (BIM, "layer 1 on the current token", mutate(BIM, ("W[C + 1:C + P, POS:POS + P - 1] = eye_p[:P - 1, :P - 1]", "W[C:C + P, POS:POS + P] = eye_p")),
     failing(BIM, "visible", "vocab", "recall")),
    (BIM, "layer 2's keys on the current token", mutate(BIM, ("W[C:C + V, PREV:PREV + V] = eye_v", "W[C:C + V, TOK:TOK + V] = eye_v")),
     failing(BIM, "visible", "vocab", "recall")),
    (BIM, "a scale too small", mutate(BIM, ("hard = 30.0 * math.sqrt(C)", "hard = 1.0")), failing(BIM, "visible", "vocab", "recall")),
    # position 0 unguarded: the second copy's first token splits layer 2's weight between key 1 and key 0, which
    # costs little at long periods (the old tests' only ones) and fails at short ones
    (BIM, "position 0 left alone", mutate(BIM, ("W[C + V, POS] = -1.0", "pass")), failing(BIM, "visible", "vocab")),
    (BIM, "a query scale of 30, not 30 sqrt(C)", mutate(BIM, ("hard = 30.0 * math.sqrt(C)", "hard = 30.0")),
     failing(BIM, "visible", "vocab", "recall")),
    # enough for 12 tokens in 24 positions (every period of the visible check's first case), not for 100 tokens in 200
    (BIM, "a query scale of 6 sqrt(C)", mutate(BIM, ("hard = 30.0 * math.sqrt(C)", "hard = 6.0 * math.sqrt(C)")),
     failing(BIM, "visible", "vocab")),
    (BIM, "an lm_head weight of 6", mutate(BIM, ("10.0 * eye_v", "6.0 * eye_v")), failing(BIM, "visible", "vocab")),
    (BIM, "layer 2's value copies A, the token before the attended one", mutate(BIM, (
        "W[2 * C:2 * C + V, TOK:TOK + V] = eye_v  # v[j] = the token at j\n        attn.c_proj.weight[OUT",
        "W[2 * C:2 * C + V, PREV:PREV + V] = eye_v\n        attn.c_proj.weight[OUT")), failing(BIM, "visible", "vocab", "recall")),
    (BIM, "correct: position 0 guarded by a key that points nowhere", mutate(BIM, (
        "W[V, TOK:TOK + V] = hard  # q[t][V] = hard for every token (the TOK coordinates always sum to 1) ...\n"
        "        W[C + V, POS] = -1.0", "W[C:C + V, POS] = -1.0")), set()),
    (AH, "no finally", mutate(AH, ("    try:\n        yield model\n    finally:  # restore, even if the block raised\n        handle.remove()", "    yield model\n    handle.remove()")),
     failing(AH, "visible")),
    (AH, "the wrong slice", mutate(AH, ("y[..., head * size:(head + 1) * size] = 0.0", "y[..., head:head + size] = 0.0")),
     failing(AH, "visible", "gpt")),
    (AH, "never restored", mutate(AH, ("        handle.remove()", "        pass")),
     failing(AH, "visible", "gpt", "circuit")),
    (AH, "correct: weights edited and restored", '''
@contextlib.contextmanager
def ablate_head(model, layer, head):
    if not 0 <= layer < len(model.transformer.h):
        raise ValueError("layer")
    attn = model.transformer.h[layer].attn
    if not 0 <= head < attn.n_head:
        raise ValueError("head")
    size = attn.c_proj.in_features // attn.n_head
    saved = attn.c_proj.weight.detach()[:, head * size:(head + 1) * size].clone()
    with torch.no_grad():
        attn.c_proj.weight[:, head * size:(head + 1) * size] = 0.0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.c_proj.weight[:, head * size:(head + 1) * size] = saved
''', set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {IS, BIM, AH}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 3


@pytest.mark.parametrize("exercise", [IS, BIM, AH])
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail

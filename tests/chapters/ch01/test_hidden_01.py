"""Chapter 01's test cells, run directly (no nbgrader) against the classic bugs, one planted bug at a time.

Each exercise's visible and hidden test cells are executed in a namespace holding the reference
solutions with ONE planted bug. Every bug must fail exactly the tests documented to target it (the
comment at the top of each cell), and the correct alternative implementations must pass everything.
The slower nbgrader round trip (tests/chapters/ch01/test_grading_01.py) checks the same on whole notebooks.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from course_lib import assets, checks
from course_lib.data import BOS, PAD, digits_to_text, reversal_batch
from tests.cell_harness import TestCells
from tests.helpers import ROOT

SOURCE = ROOT / "solutions" / "01-attention" / "attention.ipynb"
HARNESS = TestCells(SOURCE, {"torch": torch, "math": math, "F": F, "checks": checks, "assets": assets, "BOS": BOS, "PAD": PAD,
                             "digits_to_text": digits_to_text, "reversal_batch": reversal_batch})
CELLS, REFERENCE = HARNESS.cells, HARNESS.reference
cells_of, mutate, failing_tests = HARNESS.cells_of, HARNESS.mutate, HARNESS.failing_tests

NEW_STATE = "new_state = (1 - update) * candidate + update * state"
ATTEND = "context, weights = context.squeeze(1), weights.squeeze(1)"
READOUT = "model.readout(torch.cat([new_state, context, emb], dim=-1))"
CALLS_GRU_CELL = mutate("attention_decoder", ("    new_state = (1 - update) * candidate + update * state",
                                              "    new_state = model.decoder(x, state)"))
# Luong et al.'s order: update the state first (with the context of the previous state), then attend with the new state
LUONG_ORDER = mutate("attention_decoder", (
    READOUT, "model.readout(torch.cat([new_state, *additive_attention(new_state.unsqueeze(1), enc_states, enc_states, "
             "attention.W_q, attention.W_k, attention.v, src_mask.unsqueeze(1))[0].unbind(1), emb], dim=-1))"),
    ("return logits, new_state, weights", "return logits, new_state, additive_attention(new_state.unsqueeze(1), enc_states, "
                                          "enc_states, attention.W_q, attention.W_k, attention.v, src_mask.unsqueeze(1))[1].squeeze(1)"))

# exercise, bug name, solution source, the tests it must fail (and why)
CASES = [
    # the warm-ups
    ("masked_softmax", "a fully masked row left uniform", mutate("masked_softmax", ("return weights.masked_fill(~mask, 0.0)", "return weights")),
     {"masked_softmax-visible", "masked_softmax-fully_masked"}),
    ("masked_softmax", "softmax over the first axis", mutate("masked_softmax", ("return torch.softmax(scores, dim=-1)", "return torch.softmax(scores, dim=0)")),
     {"masked_softmax-visible", "masked_softmax-last_axis"}),  # without a mask only
    ("additive_attention", "mask ignored", mutate("additive_attention", ("masked_softmax(energies, mask)", "masked_softmax(energies)")),
     {"additive_attention-visible", "additive_attention-mask"}),
    ("additive_attention", "no tanh", mutate("additive_attention", ("torch.tanh(projected_q + projected_k)", "(projected_q + projected_k)")),
     {"additive_attention-visible", "additive_attention-mask", "additive_attention-batch"}),  # every test compares the formula
    ("scaled_dot_product_attention", "unscaled", mutate("scaled_dot_product_attention", (" / math.sqrt(d_k)", "")),
     {"scaled_dot_product_attention-visible", "scaled_dot_product_attention-scale"}),
    # the attention decoder (the build exercise); the trained test compares the whole translator with the course's model
    ("attention_decoder", "mask ignored", mutate("attention_decoder", ("attention.v, src_mask.unsqueeze(1))", "attention.v)")),
     {"attention_decoder-visible", "attention_decoder-query", "attention_decoder-padding", "attention_decoder-trained"}),
    ("attention_decoder", "mask inverted", mutate("attention_decoder", ("src_mask = src != PAD", "src_mask = src == PAD")),
     {"attention_decoder-visible", "attention_decoder-padding", "attention_decoder-trained", "attention_decoder-loop"}),
    # loop: the plain loop of the test builds its mask itself; query: calls decoder_step with the right mask
    ("attention_decoder", "the NEW state as the query (Luong's order)", LUONG_ORDER,
     {"attention_decoder-visible", "attention_decoder-query", "attention_decoder-trained"}),  # one-position sources hide it
    ("attention_decoder", "update gate on the wrong side", mutate("attention_decoder", (NEW_STATE, "new_state = update * candidate + (1 - update) * state")),
     {"attention_decoder-visible", "attention_decoder-gru", "attention_decoder-trained"}),
    ("attention_decoder", "reset gate before the matrix (Cho et al.)", mutate("attention_decoder", (
        "candidate = torch.tanh(n_x + reset * n_h)",
        "candidate = torch.tanh(n_x + (reset * state) @ gru.weight_hh.T.chunk(3, dim=-1)[2] + gru.bias_hh.chunk(3)[2])")),
     {"attention_decoder-visible", "attention_decoder-gru", "attention_decoder-trained"}),
    ("attention_decoder", "gates in the order (z, r, n)", mutate("attention_decoder", ("r_x, z_x, n_x =", "z_x, r_x, n_x ="),
                                                                 ("r_h, z_h, n_h =", "z_h, r_h, n_h =")),
     {"attention_decoder-visible", "attention_decoder-gru", "attention_decoder-trained"}),
    ("attention_decoder", "readout of the old state", mutate("attention_decoder", (READOUT, "model.readout(torch.cat([state, context, emb], dim=-1))")),
     {"attention_decoder-visible", "attention_decoder-readout", "attention_decoder-trained"}),
    ("attention_decoder", "readout in the order [embedding, context, state]", mutate("attention_decoder", (
        READOUT, "model.readout(torch.cat([emb, context, new_state], dim=-1))")),
     {"attention_decoder-visible", "attention_decoder-readout", "attention_decoder-trained"}),
    ("attention_decoder", "first state zeros, not the bridged summary", mutate("attention_decoder", (
        "state = torch.tanh(model.bridge(summary))", "state = torch.zeros_like(model.bridge(summary))")),
     {"attention_decoder-visible", "attention_decoder-loop", "attention_decoder-trained"}),
    ("attention_decoder", "the argmax not fed back", mutate("attention_decoder", (
        "token = logits.argmax(dim=-1)  # the model's own choice is the next step's input\n        tokens.append(token)",
        "tokens.append(logits.argmax(dim=-1))  # every step's input stays BOS")),
     {"attention_decoder-visible", "attention_decoder-loop", "attention_decoder-trained"}),
    ("attention_decoder", "no ValueError for max_len", mutate("attention_decoder", ("if max_len < 1:", "if False:")),
     {"attention_decoder-errors"}),
    ("attention_decoder", "correct, calling model.decoder", CALLS_GRU_CELL, set()),
]


def test_every_exercise_has_a_visible_test_and_hidden_tests():
    assert set(REFERENCE) == {"masked_softmax", "additive_attention", "attention_decoder", "scaled_dot_product_attention"}
    for exercise in REFERENCE:
        assert f"{exercise}-visible" in CELLS and len(cells_of(exercise)) >= 3


def test_the_build_exercise_is_at_least_20_reference_lines():
    code = [line for line in REFERENCE["attention_decoder"].split('"""')[2::2] for line in line.splitlines()]
    assert len([line for line in code if line.strip() and not line.strip().startswith("#")]) >= 20


@pytest.mark.parametrize("exercise", list(REFERENCE))
def test_the_reference_passes_every_test(exercise):
    assert failing_tests(exercise, REFERENCE[exercise]) == set()


@pytest.mark.parametrize("exercise,bug,solution,must_fail", CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_each_bug_fails_exactly_the_tests_that_target_it(exercise, bug, solution, must_fail):
    assert failing_tests(exercise, solution) == must_fail


def test_the_loop_and_padding_tests_compare_tokens_exactly_and_say_so():
    """issue 41: the `loop` test quoted a float tolerance (rtol, atol) for integer tokens; it names the token that
    differs. Planted: a translator whose argmax is not fed back (every step's input stays BOS)."""
    bug = dict(CASES_BY_NAME)["the argmax not fed back"]
    namespace = dict(HARNESS.namespace)
    for code in REFERENCE.values():
        exec(code, namespace)  # noqa: S102 - the notebook's own reference code
    exec(bug, namespace)  # noqa: S102
    with pytest.raises(checks.CheckFailed) as failure:
        exec(CELLS["attention_decoder-loop"], dict(namespace))  # noqa: S102
    message = str(failure.value)
    assert "tolerance" not in message and "rtol" not in message
    assert re.fullmatch(r"the tokens of step \d+ \(max_len = 14\), compared with a plain loop, differ in \d of 4 entries; "
                        r"the first at index \(\d,\): token \d+, expected \d+", message), message


CASES_BY_NAME = [(bug, solution) for _, bug, solution, _ in CASES]
